"""A minimal GGUF (v2/v3) reader: metadata and memory-mapped tensor data.

``gguf.GGUFReader`` builds a numpy view for every part of every field, which takes
seconds for a 49k-token vocabulary; this reader parses the header with ``struct``
in a fraction of that and hands tensors out as numpy views of a memory map.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9


class GgufFormatError(ValueError):
    pass


@dataclass(slots=True)
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # innermost first, as GGUF lists it
    data: np.ndarray  # float32/float16 values, or raw bytes (rows, bytes per row)


class GgufFile:
    def __init__(self, path: Path) -> None:
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)  # type: ignore[arg-type]
        self._pos = 0
        if bytes(self._buf[:4]) != _MAGIC:
            raise GgufFormatError(f"{path} is not a GGUF file (bad magic)")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise GgufFormatError(f"{path}: GGUF version {version} is not supported (2, 3)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        text = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return text

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, n = self._scalar("<I"), self._scalar("<Q")
            if item_type in _NUMPY:  # numeric arrays in one piece
                dtype = np.dtype(_NUMPY[item_type])
                arr = np.frombuffer(self._buf, dtype=dtype, count=n, offset=self._pos)
                self._pos += n * dtype.itemsize
                return arr.tolist()
            return [self._value(item_type) for _ in range(n)]
        if vtype not in _SCALARS:
            raise GgufFormatError(f"unknown GGUF value type {vtype} at byte {self._pos}")
        return self._scalar(_SCALARS[vtype])

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar("<I")
        shape = tuple(self._scalar("<Q") for _ in range(n_dims))
        return name, shape, self._scalar("<I"), self._scalar("<Q")

    def _tensor(
        self, start: int, name: str, shape: tuple[int, ...], type_id: int, offset: int
    ) -> GgufTensor:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GgufFormatError(f"tensor {name}: unknown GGUF tensor type {type_id}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        row_bytes = shape[0] // block * type_size
        data: np.ndarray
        raw = self._map[start + offset : start + offset + rows * row_bytes]
        if qtype is GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(rows, shape[0])
        elif qtype is GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(rows, shape[0])
        else:
            data = raw.reshape(rows, row_bytes)
        return GgufTensor(name, qtype, shape, data)
