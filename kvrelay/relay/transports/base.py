"""The transport interface: how a lease's block bytes move from P's cache into D's.

P side: ``register(kv_cache)`` returns the descriptor D receives in the HELLO reply.
D side: ``read(peer, lease_id, holder, remote_blocks, local_blocks, *, attempt)
-> handle`` (``attempt``: the request attempt holding the lease, named in tcp READs),
``poll(handle)`` and ``cancel(handle)``. A handle is PENDING while the transfer may
still write into the local blocks; once ``poll`` says DONE or FAILED it never
writes again (so the receiver may drain an aborted load, then free the blocks).
A transport never validates: the fence at RELEASE does (see lease.py).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay import env


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass
class TransferStatus:
    state: TransferState
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0  # started to ended
    # Where a transfer's time went (0: the transport does not tell): seconds from its
    # start to the first byte (tcp: P's answer to the READ), and the time.monotonic()
    # at which it ended (the receiver notices later: by a wake-up, or its next poll).
    first_byte: float = 0.0
    ended_at: float = 0.0
    # The transport's own clock of the copy, when it keeps one (nixl: NIXL's telemetry,
    # the figure vLLM's NixlConnector reports as its xfer time); 0: it keeps none.
    own_seconds: float = 0.0
    # P's verdict on the commit, when the transport asked P to commit at the end of
    # the transfer (tcp with ``commit``): the Reply a RELEASE(ok) would have got.
    verdict: Any = None


@dataclass
class PeerInfo:
    """A prefill engine as the decode side knows it after HELLO."""

    relay: str  # host:port
    engine_id: str
    descriptor: dict[str, Any] = field(default_factory=dict)


class Transport(Protocol):
    name: str

    def register(self, kv_cache: Any) -> dict[str, Any]: ...

    def read(
        self,
        peer: PeerInfo,
        lease_id: str,
        holder: str,
        remote_blocks: Sequence[int],
        local_blocks: Sequence[int],
        *,
        attempt: str = "",
    ) -> Any: ...

    def poll(self, handle: Any) -> TransferStatus: ...

    def cancel(self, handle: Any) -> None: ...


def injected_delay() -> float:
    """Fault injection for real-process tests: every transfer waits this long (seconds,
    environment KVRELAY_FAULT_TRANSFER_DELAY_S; cancellable) before it starts writing,
    so a test can act while a lease is PULLING. Zero unless set."""
    delay: float = env.get("KVRELAY_FAULT_TRANSFER_DELAY_S")
    return delay


def runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group (src, dst) block pairs into (src_start, dst_start, count) runs of
    consecutive ids on both sides: one copy per run instead of one per block."""
    out: list[tuple[int, int, int]] = []
    if not src:
        return out
    s0, d0, n = src[0], dst[0], 1
    for s, d in zip(src[1:], dst[1:], strict=True):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            out.append((s0, d0, n))
            s0, d0, n = s, d, 1
    out.append((s0, d0, n))
    return out


def byte_view(kv_cache: Any) -> Any:
    """(num_blocks, block_bytes) uint8 numpy view of a block-major torch KV cache in
    host memory. A cache in device memory has none: its transports stage (staging.py)
    or copy device to device (cuda_ipc.py)."""
    import torch

    if not (isinstance(kv_cache, torch.Tensor) and kv_cache.is_contiguous()):
        raise TypeError("the KV cache must be a contiguous block-major tensor")
    if kv_cache.device.type != "cpu":
        raise TypeError(f"a KV cache on {kv_cache.device} has no host byte view; its tcp "
                        "transport stages through host buffers (staging.StagedBlocks)")
    return kv_cache.view(torch.uint8).reshape(kv_cache.shape[0], -1).numpy()


def on_device(kv_cache: Any) -> bool:
    """True for a KV cache outside host memory (CUDA)."""
    device = getattr(kv_cache, "device", None)
    return device is not None and device.type != "cpu"
