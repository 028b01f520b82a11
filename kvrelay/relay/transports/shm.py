"""The shm transport: P's KV cache lives in POSIX shared memory; D copies blocks out of it.

The segment has an unguessable name and owner-only permissions (0600): it trusts
processes of the same user on the host; across a trust boundary use tcp. D attaches
once per segment and copies each run of consecutive blocks with one tensor copy,
straight from the shared cache into its own cache.

The copy is a one-sided read P cannot stop: it is validated by the fence at
RELEASE (lease.py), never trusted on its own.

Segments are named ``kvrelay-<pid namespace>-<owner pid>-<128 random bits>``. P normally unlinks
its segment at exit, and Python's resource tracker does if P is killed; when both
die together (a process group or container killed) the segment would stay in
/dev/shm. So a starting P first sweeps stale segments: only its own user's, with
this name prefix, created in its own pid namespace (a container sharing /dev/shm
with ``--ipc=host`` numbers its processes differently), whose owner process is gone
(``sweep_stale_segments``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np
import torch

from kvrelay.relay.transports.base import (
    PeerInfo,
    TransferState,
    TransferStatus,
    byte_view,
    injected_delay,
    runs,
)

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "kvrelay-"
_SEGMENT_NAME = re.compile(r"kvrelay-(\d+)-(\d+)-[0-9a-f]{32}")
# uint8: an fp8_e4m3 cache's storage (codes and scales: geometry.py)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "uint8": torch.uint8}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_CREATED_HERE: set[str] = set()  # segments this process created (and will unlink)


class ShmKvCache:
    """A KV cache tensor over a new shared-memory segment (P side).

    ``factory`` fits ``kv_cache_factory`` of the model loader.
    """

    def __init__(self) -> None:
        self.segment: shared_memory.SharedMemory | None = None
        self.tensor: torch.Tensor | None = None

    def factory(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        sweep_stale_segments()
        name = f"{SEGMENT_PREFIX}{pid_namespace()}-{os.getpid()}-{secrets.token_hex(16)}"
        self.segment = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
        _CREATED_HERE.add(self.segment.name)
        t = torch.frombuffer(self.segment.buf, dtype=dtype, count=torch.Size(shape).numel())
        self.tensor = t.view(shape)
        self.tensor.zero_()
        return self.tensor

    def descriptor(self) -> dict[str, Any]:
        assert self.segment is not None and self.tensor is not None
        return {
            "name": self.segment.name,
            "shape": list(self.tensor.shape),
            "dtype": DTYPE_NAMES[self.tensor.dtype],
        }

    def close(self) -> None:
        if self.segment is not None:
            self.tensor = None
            seg, self.segment = self.segment, None
            with contextlib.suppress(BufferError):  # a view is still alive; unlink anyway
                seg.close()
            seg.unlink()


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove kvrelay segments left by dead prefill engines; return their names.

    A segment is removed only if it is a regular file of this user, named
    ``kvrelay-<our pid namespace>-<pid>-<32 hex>``, and process ``pid`` is gone: no
    such process, or one that started after the segment was created (the pid was
    reused). Anything else, including a live owner we cannot inspect, is left alone."""
    try:
        names = os.listdir(shm_dir)
    except OSError:  # no /dev/shm (not Linux): nothing to sweep
        return []
    removed: list[str] = []
    uid, ns, me = os.getuid(), pid_namespace(), os.getpid()
    for name in names:
        m = _SEGMENT_NAME.fullmatch(name)
        if m is None or int(m.group(1)) != ns or int(m.group(2)) == me:
            continue
        pid = int(m.group(2))
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue
            if not _owner_gone(pid, min(st.st_ctime, st.st_mtime)):
                continue
            os.unlink(path)
        except OSError:
            continue  # gone meanwhile, or not ours to remove
        log.warning("removed stale shared-memory KV segment %s (%d bytes): its owner, "
                    "process %d, is gone", path, st.st_size, pid)
        removed.append(name)
    return removed


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
        return int(link[link.index("[") + 1 : -1])
    except (OSError, ValueError):
        return 0


def _owner_gone(pid: int, created: float) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        started = btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    # The owner started before it created the segment; a process that started
    # later only reuses the pid (2 s of slack for btime's whole seconds).
    return started > created + 2.0


def attach(descriptor: dict[str, Any]) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
    seg = shared_memory.SharedMemory(name=descriptor["name"])
    if descriptor["name"] not in _CREATED_HERE:
        # Python < 3.13 registers attached segments too and would unlink P's segment
        # when this process exits; the segment is P's to remove.
        resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    shape = tuple(descriptor["shape"])
    dtype = DTYPES[descriptor["dtype"]]
    t = torch.frombuffer(seg.buf, dtype=dtype, count=torch.Size(shape).numel()).view(shape)
    return seg, t


def copy_blocks(dst: torch.Tensor, src: torch.Tensor, remote: Sequence[int],
                local: Sequence[int]) -> None:
    """One memcpy per run of consecutive blocks, on byte views of both caches."""
    d, s = byte_view(dst), byte_view(src)
    for s0, d0, n in runs(remote, local):
        np.copyto(d[d0 : d0 + n], s[s0 : s0 + n])


@dataclass
class ShmHandle:
    thread: threading.Thread | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    status: TransferStatus = field(default_factory=lambda: TransferStatus(TransferState.PENDING))


class ShmTransport:
    name = "shm"

    def __init__(self, kv_cache: torch.Tensor | None = None, *, threaded: bool = True) -> None:
        self.kv_cache = kv_cache
        self.threaded = threaded
        self.shm_cache: ShmKvCache | None = None
        self._attached: dict[str, tuple[shared_memory.SharedMemory, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.delay = injected_delay()

    def register(self, kv_cache: Any) -> dict[str, Any]:
        """P side: ``kv_cache`` must be the tensor of a ``ShmKvCache``."""
        if isinstance(kv_cache, ShmKvCache):
            self.shm_cache = kv_cache
            return kv_cache.descriptor()
        raise TypeError("the shm transport needs the KV cache allocated by ShmKvCache.factory")

    def read(self, peer: PeerInfo, lease_id: str, holder: str, remote_blocks: Sequence[int],
             local_blocks: Sequence[int], *, attempt: str = "") -> ShmHandle:
        h = ShmHandle()
        args = (h, peer.descriptor, list(remote_blocks), list(local_blocks))
        if self.threaded:
            h.thread = threading.Thread(target=self._run, args=args, daemon=True)
            h.thread.start()
        else:
            self._run(*args)
        return h

    def poll(self, handle: ShmHandle) -> TransferStatus:
        return handle.status

    def cancel(self, handle: ShmHandle) -> None:
        handle.cancelled.set()

    def close(self) -> None:
        with self._lock:
            for seg, _ in self._attached.values():
                with contextlib.suppress(BufferError):
                    seg.close()
            self._attached.clear()

    def _remote(self, descriptor: dict[str, Any]) -> torch.Tensor:
        with self._lock:
            got = self._attached.get(descriptor["name"])
            if got is None:
                got = self._attached[descriptor["name"]] = attach(descriptor)
            return got[1]

    def _run(self, h: ShmHandle, descriptor: dict[str, Any], remote: list[int],
             local: list[int]) -> None:
        t0 = time.perf_counter()
        try:
            assert self.kv_cache is not None, "the shm transport has no local KV cache"
            src = self._remote(descriptor)
            dst = self.kv_cache
            if self.delay:
                h.cancelled.wait(self.delay)
            if h.cancelled.is_set():
                raise ConnectionAbortedError("transfer cancelled")
            copy_blocks(dst, src, remote, local)
            nbytes = len(local) * dst[0].numel() * dst.element_size()
            h.status = TransferStatus(TransferState.DONE, nbytes=nbytes,
                                      seconds=time.perf_counter() - t0)
        except Exception as e:  # any failure ends the transfer; the handle never hangs
            h.status = TransferStatus(TransferState.FAILED, error=f"shm transfer failed: {e!r}")
        finally:
            if h.status.state is TransferState.PENDING:  # BaseException: still never hang
                h.status = TransferStatus(TransferState.FAILED,
                                          error="shm transfer failed: copy interrupted")
