"""2 MiB pages (transparent huge pages) under the big, long-lived CPU tensors.

A decode step streams every weight once: 269 MB for SmolLM2-135M in bfloat16, about
66,000 pages of 4 KiB, each one more TLB miss and page walk. Linux backs anonymous
memory with 2 MiB pages where a process asks for them (``madvise(MADV_HUGEPAGE)``)
when transparent huge pages are in their ``madvise`` mode, the default of many
distributions (``always`` needs no asking, ``never`` refuses). The advice only helps
memory not yet touched, so it goes on fresh anonymous mappings (zero-filled, committed
page by page as they are first written), never on memory from the C heap: the decode
GEMMs' packed weights are copied into such memory as they are packed (``Arena``), and
the KV cache is allocated there (``zeros``; the loader then faults it in on a background
thread, ``populate_in_background``). Measured on 2 vCPU Zen 4: batch-8 decode
step p50 about 4% shorter, offline 32 x 128 / 128 2-7% faster (docs/model.md).
``KVRELAY_HUGEPAGES=0`` stops kvrelay asking (in the kernel's ``always`` mode the
pages are huge anyway).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import os
import sys
import threading

import torch

from kvrelay import env

log = logging.getLogger("kvrelay.model")

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor in an arena starts on a cache line


def enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and env.get("KVRELAY_HUGEPAGES")


def fresh(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed memory from a new anonymous mapping (uint8), starting on a
    2 MiB boundary, advised for 2 MiB pages before anything touches it. The tensor
    keeps the mapping alive."""
    span = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
    # Private: a shared anonymous mapping is shmem, which follows shmem_enabled instead.
    m = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(m, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE  # mmap's start is only 4 KiB-aligned
    if enabled():
        m.madvise(mmap.MADV_HUGEPAGE, skip, span)
    return raw[skip : skip + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on fresh, advised memory (see ``fresh``)."""
    return fresh(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


class Arena:
    """Copies of tensors, laid one after another in chunks of fresh, advised memory.

    A copy is a view of its chunk, which lives as long as any view of it. Chunks are
    ``chunk_bytes`` (or one tensor, if larger): copying as each tensor is made keeps
    the peak at the arena plus one tensor, where gathering a finished list would hold
    every original as well."""

    def __init__(self, chunk_bytes: int = 64 << 20) -> None:
        self._chunk_bytes = chunk_bytes
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        if self._used + n > self._buf.numel():
            self._buf = fresh(max(self._chunk_bytes, n))
            self._used = 0
        view = self._buf[self._used : self._used + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        self._used += -(-n // _ALIGN) * _ALIGN
        return view


MADV_POPULATE_WRITE = 23  # Linux 5.14 on; Python's mmap module lacks the constant


def populate_wanted() -> bool:
    """``KVRELAY_KV_POPULATE=0`` leaves the KV cache to be committed as requests first
    write it; Linux only (the advice is Linux's)."""
    return sys.platform == "linux" and env.get("KVRELAY_KV_POPULATE")


def populate_in_background(t: torch.Tensor, chunk_bytes: int = 32 << 20) -> threading.Thread:
    """Faults the pages of ``t`` (from ``fresh``: page-aligned) in from its start on a
    daemon thread, ``madvise(MADV_POPULATE_WRITE)`` a chunk at a time: as a write
    would, without changing a byte, so the engine may write the same memory meanwhile.
    For the KV cache: its first write of a page otherwise costs the step that makes it
    (measured on an AMX Xeon VM: 2.3 s a GiB of 2 MiB pages, 30-40 ms of a 1,024-token
    prefill step while the pool, which hands out never-used blocks before evicting
    cached ones, walks through the cache; docs/model.md). Stops where the kernel
    refuses: quietly for EINVAL (older than 5.14), with a warning otherwise (ENOMEM:
    the cache is larger than the memory left; the engine then faults pages in itself,
    as before)."""
    addr, size = t.data_ptr(), t.numel() * t.element_size()

    def run() -> None:
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            for off in range(0, size, chunk_bytes):
                n = min(chunk_bytes, size - off)
                if madvise(addr + off, n, MADV_POPULATE_WRITE) != 0:
                    err = ctypes.get_errno()
                    (log.debug if err == errno.EINVAL else log.warning)(
                        "KV cache populate stopped at %d of %d bytes: %s", off, size,
                        os.strerror(err))
                    return
        except Exception:  # an edge thread: its failure costs speed only
            log.exception("KV cache populate failed")

    # the thread's arguments keep t (and so its mapping) alive until it is done
    th = threading.Thread(target=lambda _keep: run(), args=(t,), name="kv-populate",
                          daemon=True)
    th.start()
    return th
