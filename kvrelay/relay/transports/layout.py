"""Which bytes of registered memory make up KV block ``b``: the layout a relay names.

kvrelay's own cache is block-major (``block_major``): block ``b`` is one contiguous
piece holding every layer's K and V. vLLM (0.32+) gives each layer a view
``[B, H, N, C]`` (kernel blocks, heads, tokens per kernel block, content: K and V fused,
or MLA's latent) of one backing allocation, strided in the order of its layout
(``KVCacheLayout``: LBHNC on CPU, LBNHC the GPU default, block-outermost BLHNC, ...).

Two things describe such a cache, and only the first is shared:

- ``KvLayout``, the description: the logical dims of one block (layers, kernel blocks
  per manager block, heads, tokens, content, element size), the physical order of
  those dims (read from the strides, outermost first; dims of size 1 occupy no bytes
  and are left out), and the attention backend. Its ``name`` is what HELLO carries and
  the compat hash covers: a P and a D whose blocks differ in any of these are refused
  at HELLO with both names. No address, stride or device: each side's own.
- ``KvPlacement``, this side's: the buffers, each layer's offset of block 0 in one, the
  byte stride of each dim. ``ranges(block_ids)`` says which bytes hold the blocks.

The stream of a READ (tcp) walks the dims in their physical order with B standing for
the position in the request's block list: LBHNC streams layer by layer, block by
block within a layer; LHBNC layer, head, block; BLHNC block, layer. Both sides share
the order (the HELLO checked it), so byte ``i`` lands on the same (layer, block, head,
token, element) on D as it left on P, however each side's ids run. A run of
consecutive block ids whose bytes touch (B directly outside a dense block interior)
is one range per outer index: one iovec, one NIXL descriptor.

A manager block of ``k`` kernel blocks (FlashMLA's 64-token kernel blocks under
``--block-size 128``) is dim K inside B: dim 0 of a view counts kernel blocks, and
manager block ``b`` is kernel blocks ``b*k .. b*k+k-1`` (vLLM's
``group_kernel_blocks``).

The description of today's CPU cache (each layer one contiguous tensor, no kernel
split, the CPU backend) keeps today's name ``regions:<layers>x<piece bytes>``, so its
compat hash is unchanged and a P or D one release behind keeps pulling.

Neither says where the bytes live: ``layer_cache`` gives a ``HostCache`` (numpy byte
arrays: tcp reads and writes the blocks in place) for a cache in host memory and a
``TensorCache`` (flat byte tensors on the device) for one on a GPU, which tcp stages
through pinned host buffers (staging.py), nixl registers as VRAM and cuda_ipc exports.
The description and the stream are the same either way, so a GPU P serves a CPU D.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvrelay.relay.transports.base import runs

BLOCK_MAJOR = "block_major"
DIMS = "LBKHNC"  # layer, manager block, kernel block in it, head, token, content
# Backends whose contiguous per-layer cache is today's ``regions:`` layout: vLLM-CPU's,
# and "" where the backend is not known (kvrelay's tests, an older vLLM).
LEGACY_BACKENDS = ("", "CPU_ATTN")
DEVICES = ("cpu", "cuda")  # where a cache may live (layer_cache)


@dataclass(frozen=True)
class KvLayout:
    """A block as both sides must cut it (see the module docstring)."""

    order: str  # letters of DIMS with size > 1 (B always), outermost first
    layers: int
    kernel_blocks: int  # k: kernel blocks per manager block
    heads: int
    tokens: int  # per kernel block
    content: int  # elements
    element_size: int
    backend: str = ""
    contiguous: bool = False  # every layer one dense tensor (today's regions layout)

    @property
    def piece_bytes(self) -> int:
        """One layer's bytes of one block."""
        return (self.kernel_blocks * self.heads * self.tokens * self.content
                * self.element_size)

    @property
    def block_bytes(self) -> int:
        return self.layers * self.piece_bytes

    @property
    def is_regions(self) -> bool:
        return (self.contiguous and self.kernel_blocks == 1
                and self.backend in LEGACY_BACKENDS)

    @property
    def name(self) -> str:
        if self.is_regions:
            return f"regions:{self.layers}x{self.piece_bytes}"
        return (f"strided:{self.order}:L{self.layers},K{self.kernel_blocks},H{self.heads},"
                f"N{self.tokens},C{self.content}x{self.element_size}B:"
                f"{self.backend or 'unknown'}")


@dataclass(frozen=True)
class KvPlacement:
    """Where this side's blocks lie: ``buffers`` (address, bytes), per layer the buffer
    and byte offset of its block 0, and per letter of ``layout.order`` its byte stride
    (L's is 0 where L is outermost: layers are then found by their offsets)."""

    layout: KvLayout
    num_blocks: int
    buffers: tuple[tuple[int, int], ...]
    bases: tuple[tuple[int, int], ...]
    strides: tuple[int, ...]

    def ranges(self, block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """(buffer, offset, bytes) holding ``block_ids``, in stream order."""
        order, strides = self.layout.order, self.strides
        p = order.index("B")
        s_b = strides[p]
        chunk, grid = _inner(self.layout, order[p + 1:], strides[p + 1:])
        if grid == [0] and s_b == chunk:  # consecutive blocks touch: one range per run
            items = [(s * s_b, n * chunk) for s, _, n in runs(block_ids, block_ids)]
        else:
            items = [(b * s_b + g, chunk) for b in block_ids for g in grid]
        return [(buf, off + o, n) for buf, off in self._outer(p) for o, n in items]

    def _outer(self, p: int) -> list[tuple[int, int]]:
        order, strides = self.layout.order, self.strides
        starts = list(self.bases) if order[:1] == "L" else [self.bases[0]]
        for d in range(1 if order[:1] == "L" else 0, p):
            size = _size(self.layout, order[d], self.num_blocks)
            starts = [(buf, off + i * strides[d]) for buf, off in starts for i in range(size)]
        return starts

    def to_wire(self) -> dict[str, Any]:
        return {"num_blocks": self.num_blocks, "buffers": [list(b) for b in self.buffers],
                "bases": [list(b) for b in self.bases], "strides": list(self.strides)}

    def remote(self, wire: Mapping[str, Any]) -> KvPlacement:
        """The peer's placement of this layout (the HELLO proved it the same)."""
        return KvPlacement(
            self.layout, int(wire["num_blocks"]),
            tuple((int(a), int(n)) for a, n in wire["buffers"]),
            tuple((int(b), int(o)) for b, o in wire["bases"]),
            tuple(int(s) for s in wire["strides"]))


def _size(layout: KvLayout, dim: str, num_blocks: int) -> int:
    return {"L": layout.layers, "B": num_blocks, "K": layout.kernel_blocks,
            "H": layout.heads, "N": layout.tokens, "C": layout.content}[dim]


def _inner(layout: KvLayout, dims: str, strides: Sequence[int]) -> tuple[int, list[int]]:
    """One block's bytes below B: the longest contiguous chunk, and the offsets of the
    chunks (in physical order) where the dims above it do not touch."""
    chunk, i = layout.element_size, len(dims)
    while i and strides[i - 1] == chunk:
        i -= 1
        chunk *= _size(layout, dims[i], 0)
    offsets = [0]
    for d in range(i):
        size = _size(layout, dims[d], 0)
        offsets = [o + j * strides[d] for o in offsets for j in range(size)]
    return chunk, offsets


def layer_cache(kv_caches: Mapping[str, Any], num_blocks: int | None = None,
                backend: str = "") -> HostCache | TensorCache:
    """vLLM's per-layer KV views, described and placed (``describe``): in host memory a
    ``HostCache`` (a byte array per buffer: tcp reads and writes the blocks in place);
    on a device (CUDA) a ``TensorCache`` (a flat byte tensor per buffer: tcp stages
    through pinned host buffers, nixl registers VRAM, cuda_ipc exports the buffers)."""
    for name, t in kv_caches.items():
        device = getattr(t, "device", None)
        if device is None or device.type not in DEVICES:
            raise ValueError(f"KV layer {name}: the relay moves KV caches in host memory or "
                             f"on a CUDA device, got {device or type(t).__name__}")
    first = next(iter(kv_caches.values()), None)
    if first is not None and first.device.type != "cpu":
        return tensor_cache(kv_caches, num_blocks, backend)
    placement, storages = describe(kv_caches, num_blocks, backend)
    return HostCache(placement, [_bytes_of(s) for s in storages])


def named_as(cache: HostCache | TensorCache, whole: HostCache | TensorCache
             ) -> HostCache | TensorCache:
    """A head slice of ``whole`` (a prefill worker's heads), named as that worker's own
    cache is: the same dims in the same physical order with fewer heads, so the same
    stream, and dense (today's ``regions`` name) where a cache of those heads in that
    order, its blocks packed as ``whole``'s are, is dense (heads outside the blocks are
    not, unless one head drops the dim). Only the name changes: the slice's ranges stay
    its own (one per block where the heads are strided apart)."""
    layout = dataclasses.replace(cache.layout, contiguous=_packed_dense(cache.layout, whole))
    cache.placement = dataclasses.replace(cache.placement, layout=layout)
    return cache


def widened(cache: HostCache | TensorCache, k: int) -> KvLayout:
    """The layout of the cache of which this one is a head slice of ``k`` (a prefill
    worker's, at 1/k of this engine's tensor-parallel size): the same dims in the same
    order with ``k`` times the heads, named as ``named_as`` would name it. Raises
    ValueError where this cache holds one head (its order says nothing of where the
    heads go)."""
    if "H" not in cache.layout.order:
        raise ValueError("this engine's workers hold one KV head each: where a prefill "
                         "worker's heads lie in its blocks is not known here")
    wide = dataclasses.replace(cache.layout, heads=cache.layout.heads * k)
    return dataclasses.replace(wide, contiguous=_packed_dense(wide, cache))


def _packed_dense(layout: KvLayout, like: HostCache | TensorCache) -> bool:
    """Would a cache of ``layout``, its blocks packed as ``like``'s are (no padding where
    ``like`` has none), be dense (``_dense``)?"""
    w_order, w_strides = like.layout.order, like.placement.strides
    w_p = w_order.index("B")
    packed = w_strides[w_p] == layout.element_size * math.prod(
        _size(like.layout, d, 0) for d in w_order[w_p + 1:])
    strides: list[int] = []  # a packed cache of this layout
    extent = layout.element_size
    for d in reversed(layout.order):
        strides.insert(0, extent)
        extent *= _size(layout, d, like.num_blocks)
    if layout.order[0] == "L":
        strides[0] = 0  # the placement's convention: layers found by their offsets
    return packed and _dense(layout, strides)


def head_part(cache: HostCache | TensorCache, i: int, k: int) -> HostCache | TensorCache:
    """Heads ``i*h .. i*h+h-1`` (h = heads / k) of a described cache, as a cache of
    those heads (the same buffers, no copy): what part ``i`` of ``k`` of a lease serves
    to a decode worker holding those heads alone, and the slice of a decode worker's
    cache that one prefill worker of k times its tensor-parallel size fills. Raises
    ValueError where the heads do not split in ``k``."""
    layout, placement = cache.layout, cache.placement
    if k < 1 or layout.heads % k or "H" not in layout.order:
        raise ValueError(f"{layout.heads} KV heads do not split into {k} parts")
    h = layout.heads // k
    d = layout.order.index("H")
    offset = i * h * placement.strides[d]
    order, strides = layout.order, placement.strides
    if h == 1:  # a dim of size 1 occupies no bytes
        order, strides = order[:d] + order[d + 1:], strides[:d] + strides[d + 1:]
    part = KvPlacement(dataclasses.replace(layout, order=order, heads=h, contiguous=False),
                       placement.num_blocks, placement.buffers,
                       tuple((b, o + offset) for b, o in placement.bases), tuple(strides))
    return dataclasses.replace(cache, placement=part)


def tensor_cache(kv_caches: Mapping[str, Any], num_blocks: int | None = None,
                 backend: str = "") -> TensorCache:
    """The same description with torch byte tensors, on the views' own device (a CPU
    cache too: the staged tcp path runs on CPU tensors in tests)."""
    placement, storages = describe(kv_caches, num_blocks, backend)
    return TensorCache(placement, [_tensor_of(s) for s in storages])


def describe(kv_caches: Mapping[str, Any], num_blocks: int | None = None,
             backend: str = "") -> tuple[KvPlacement, list[Any]]:
    """The layout and placement of per-layer ``[B, H, N, C]`` views (any device: shape,
    strides, element size and storage addresses only), in the model's layer order, and
    the distinct storages they view. ``num_blocks``: the manager's block count (dim 0
    counts ``num_blocks * k`` kernel blocks); None: no kernel split. Raises ValueError
    naming the layer whose view this transport cannot cut into blocks."""
    name, t, storages, bases = _layers(kv_caches)
    e = t.element_size()
    nb = num_blocks or int(t.shape[0])
    if t.shape[0] % nb:
        raise ValueError(f"KV layer {name}: {t.shape[0]} kernel blocks do not cut into "
                         f"{nb} manager blocks")
    k = int(t.shape[0]) // nb
    heads, tokens, content = (int(x) for x in t.shape[1:])
    s_b, s_h, s_n, s_c = (x * e for x in t.stride())
    dims = {"B": (nb, k * s_b), "K": (k, s_b), "H": (heads, s_h), "N": (tokens, s_n),
            "C": (content, s_c)}
    layers = len(bases)
    step = bases[1][1] - bases[0][1] if layers > 1 else 0
    if step > 0 and all((b, o) == (bases[0][0], bases[0][1] + i * step)
                        for i, (b, o) in enumerate(bases)):
        dims["L"] = (layers, step)  # layers a fixed stride apart in one buffer
    kept = [d for d in DIMS if d in dims and (d == "B" or dims[d][0] > 1)]
    # A tie is a dim of size 1 whose stride is its inside's extent: B (one block) is
    # then inside the dim it ties with.
    kept.sort(key=lambda d: (-dims[d][1], d == "B", DIMS.index(d)))
    if layers > 1 and "L" not in dims:  # layers apart, in no one progression: outermost
        kept.insert(0, "L")
    strides = [0 if i == 0 and d == "L" else dims[d][1] for i, d in enumerate(kept)]
    _check_cuts(name, t, kept, [dims.get(d, (layers, 0)) for d in kept], e)
    _check_bounds(kv_caches, t, storages, bases)
    layout = KvLayout("".join(kept), layers, k, heads, tokens, content, e, backend)
    layout = dataclasses.replace(layout, contiguous=_dense(layout, strides))
    buffers = tuple((int(s.data_ptr()), int(s.nbytes())) for s in storages)
    return KvPlacement(layout, nb, buffers, tuple(bases), tuple(strides)), storages


def _layers(kv_caches: Mapping[str, Any]) -> tuple[str, Any, list[Any], list[tuple[int, int]]]:
    """The first layer's name and view, the distinct storages, and per layer the index
    of its storage and its byte offset there; every layer shaped as the first."""
    import torch

    first: tuple[str, Any] | None = None
    storages: dict[int, Any] = {}
    bases: list[tuple[int, int]] = []
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"KV layer {name}: expected a [blocks, heads, tokens, content] "
                             f"tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if first is None:
            first = (name, t)
        elif (t.shape, t.stride(), t.dtype, t.device) != (
                first[1].shape, first[1].stride(), first[1].dtype, first[1].device):
            raise ValueError(
                f"KV layer {name}: shape {tuple(t.shape)} strides {t.stride()} {t.dtype} "
                f"differs from layer {first[0]}'s {tuple(first[1].shape)} "
                f"{first[1].stride()} {first[1].dtype}")
        s = t.untyped_storage()
        index = storages.setdefault(s.data_ptr(), (len(storages), s))[0]
        bases.append((index, int(t.storage_offset()) * t.element_size()))
    if first is None:
        raise ValueError("no KV layers were registered")
    return first[0], first[1], [s for _, s in storages.values()], bases


def _dense(layout: KvLayout, strides: Sequence[int]) -> bool:
    """Each layer one dense tensor in logical order: today's ``regions`` test
    (is_contiguous(), but blind to the block count: one block makes any order so)."""
    order = layout.order
    p = order.index("B")
    chunk, grid = _inner(layout, order[p + 1:], strides[p + 1:])
    inside = [DIMS.index(d) for d in order[p + 1:]]
    return (set(order[:p]) <= {"L"} and inside == sorted(inside) and grid == [0]
            and chunk == strides[p] == layout.piece_bytes)


def _check_cuts(name: str, t: Any, order: list[str], dims: list[tuple[int, int]],
                e: int) -> None:
    """Each dim's stride clears everything inside it: blocks, layers and heads never
    share a byte, so a block's bytes are its own."""
    inner = e
    for d, (size, stride) in zip(reversed(order), reversed(dims), strict=True):
        if d == "L" and stride == 0:
            continue
        if stride < inner:
            raise ValueError(
                f"KV layer {name}: shape {tuple(t.shape)} strides {t.stride()} overlap in "
                f"dim {d} ({stride} B apart, {inner} B inside); the relay moves only "
                "layouts whose blocks, layers and heads are disjoint")
        inner = stride * size


def _check_bounds(kv_caches: Mapping[str, Any], t: Any, storages: list[Any],
                  bases: list[tuple[int, int]]) -> None:
    e = t.element_size()
    extent = e + sum((n - 1) * s * e for n, s in zip(t.shape, t.stride(), strict=True))
    sizes = [int(s.nbytes()) for s in storages]
    for name, (buf, off) in zip(kv_caches, bases, strict=True):
        if off + extent > sizes[buf]:
            raise ValueError(f"KV layer {name}: its view ends {off + extent} B into a "
                             f"storage of {sizes[buf]} B")


def _tensor_of(storage: Any) -> Any:
    """A flat uint8 tensor over a whole storage, on its device."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (int(storage.nbytes()),), (1,))


def _bytes_of(storage: Any) -> np.ndarray:
    return np.asarray(_tensor_of(storage).numpy())


@dataclass
class _Described:
    """A cache with its placement: the layout and block count every side reads."""

    placement: KvPlacement

    @property
    def layout(self) -> KvLayout:
        return self.placement.layout

    @property
    def num_blocks(self) -> int:
        return self.placement.num_blocks


@dataclass
class HostCache(_Described):
    """A described cache in host memory: its placement and one uint8 array per buffer
    (the arrays keep the storages alive)."""

    arrays: list[np.ndarray]

    def views(self, block_ids: Sequence[int]) -> list[memoryview]:
        """One flat memoryview per range of ``block_ids``, in stream order (no copies)."""
        arrays = self.arrays
        return [memoryview(arrays[b][o:o + n].data) for b, o, n in self.placement.ranges(block_ids)]


@dataclass
class TensorCache(_Described):
    """A described cache as torch tensors: one flat uint8 tensor per buffer, on the
    cache's device (they keep the storages alive). No host view: the tcp transport
    stages it (staging.py), nixl registers it (VRAM on a GPU), cuda_ipc exports it."""

    tensors: list[Any]

    @property
    def device(self) -> Any:
        return self.tensors[0].device

    def pieces(self, block_ids: Sequence[int]) -> list[Any]:
        """One flat byte tensor per range of ``block_ids``, in stream order (views)."""
        ts = self.tensors
        return [ts[b][o:o + n] for b, o, n in self.placement.ranges(block_ids)]


def cut_pieces(local: Sequence[tuple[int, int, int]], remote: Sequence[tuple[int, int, int]]
               ) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    """Cut two lists of (buffer, offset, bytes) covering the same stream at each other's
    boundaries: piece ``i`` of the first side receives piece ``i`` of the second."""
    out: list[tuple[tuple[int, int, int], tuple[int, int, int]]] = []
    i = j = li = rj = 0
    while i < len(local) and j < len(remote):
        n = min(local[i][2] - li, remote[j][2] - rj)
        out.append(((local[i][0], local[i][1] + li, n), (remote[j][0], remote[j][1] + rj, n)))
        li, rj = li + n, rj + n
        if li == local[i][2]:
            i, li = i + 1, 0
        if rj == remote[j][2]:
            j, rj = j + 1, 0
    if i < len(local) or j < len(remote):
        raise ValueError("the prefill engine's blocks and these differ in size")
    return out
