"""The relay's two sides, assembled once for both engine adapters (kvrelay's engine
server, kvrelay/server/disagg.py; vLLM's worker, kvrelay/vllm/): a prefill side (lease
table, relay server and the transports it serves) over the engine's ``LeaseBlocks``
port, and a decode side (relay client, transport, receiver) over its ``KvLoads`` port.

Every transport choice (``kv_transport``: auto, shm, cuda_ipc, tcp, nixl) and every
timeout derived from the lease timeout is made here, so the adapters cannot disagree:
- a decode side's socket waits are bounded by half the lease timeout, so a frozen or
  cut-off prefill engine makes it fall back within the lease timeout;
- it heartbeats a lease four times per lease timeout (at least every 50 ms apart);
- it asks again for a lease P has named but not made (NOT_YET) for at most
  ``NOT_YET_TIMEOUT`` (P's worker makes it when its next step starts);
- a prefill side's reply or stream send gives up after the lease timeout (the decode
  engine lost the lease by then anyway), and idle connections outlive heartbeats.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.relay.client import RelayClient
from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.port import KvLoads, LeaseBlocks
from kvrelay.relay.receiver import Policy, Receiver, ReceiverConfig
from kvrelay.relay.server import RelayServer, RelayServerConfig
from kvrelay.relay.transports.auto import AutoLink, AutoTransport
from kvrelay.relay.transports.base import on_device
from kvrelay.relay.transports.cuda_ipc import CudaIpcTransport
from kvrelay.relay.transports.shm import ShmTransport
from kvrelay.relay.transports.tcp import TcpTransport

log = logging.getLogger(__name__)

KV_TRANSPORTS = ("auto", "shm", "cuda_ipc", "tcp", "nixl")
NOT_YET_TIMEOUT = 10.0
NIXL_WITHOUT_SECRET = (
    "kv_transport nixl without a relay secret: any peer that reaches the relay port gets "
    "the NIXL metadata, with which it can read this engine's KV cache")


@dataclass(frozen=True)
class SideSettings:
    """What both sides are built from (the server's flags, the connector's extra config)."""

    kv_transport: str
    lease_timeout: float  # an un-acquired (or un-heartbeated) lease is freed after this
    lease_max: float  # hard cap on a lease's life (and on one copy)
    secret: bytes | None = None  # HMAC key of HELLO
    relay_host: str = "127.0.0.1"  # prefill: the address decode engines dial
    relay_port: int = 0  # prefill: 0 = any free port
    relay_advertise_host: str = ""  # prefill: the host D is told, when not relay_host

    @property
    def io_timeout(self) -> float:
        return self.lease_timeout / 2


@dataclass(eq=False)
class PrefillParts:
    table: LeaseTable
    server: RelayServer
    nixl: Any = None  # the NIXL agent, when served: it must live as long as the relay


@dataclass(eq=False)
class DecodeParts:
    receiver: Receiver
    clients: list[RelayClient]  # every client whose replies the receiver must see
    transport: Any


def check_transport(kv_transport: str, kv_cache: Any) -> None:
    """A transport that cannot serve this cache: an error naming the flag."""
    if kv_transport == "shm" and on_device(kv_cache):
        raise ValueError(f"--kv-transport shm needs a KV cache in host memory (--device "
                         f"cpu); this one is on {kv_cache.device}: use auto, cuda_ipc or tcp")
    if kv_transport == "cuda_ipc" and not on_device(kv_cache):
        raise ValueError("--kv-transport cuda_ipc needs a KV cache on a CUDA device "
                         "(--device cuda); use auto, shm or tcp")


def build_prefill_side(
    blocks: LeaseBlocks, settings: SideSettings, *, engine_id: str, compat: str,
    kv_cache: Any, kv_blocks: Any, layout: str = "block_major", kv_dtype: str = "",
    shm: dict[str, Any] | None = None,
    lock: threading.Lock | None = None, clock: Callable[[], float] = time.monotonic,
    part_blocks: Callable[[int, int], Any] | None = None,
    splits: Callable[[int], bool] | None = None,
) -> PrefillParts:
    """The lease table over ``blocks`` and a started relay server for it. ``kv_cache``:
    what NIXL registers and CUDA IPC exports (a tensor, or vLLM's regions); ``kv_blocks``:
    how the tcp transport reads blocks; ``shm``: the shared-memory cache's descriptor;
    ``part_blocks``: how tcp reads head slice i of k of them, and ``splits``: whether
    the heads split in k (leases cut into parts, for decode engines of more
    tensor-parallel workers: the table splits only with both)."""
    table = LeaseTable(blocks, engine_id=engine_id, acquire_timeout=settings.lease_timeout,
                       hard_cap=settings.lease_max,
                       splittable=splits if part_blocks is not None else None)
    transports, nixl = _served(settings, kv_cache, shm)
    cfg = RelayServerConfig(
        compat=compat, host=settings.relay_host, port=settings.relay_port,
        advertise_host=settings.relay_advertise_host,
        secret=settings.secret, transports=transports, layout=layout, kv_dtype=kv_dtype,
        send_timeout=settings.lease_timeout,
        idle_timeout=max(120.0, 2 * settings.lease_timeout))
    server = RelayServer(table, lock or threading.Lock(), cfg, kv_blocks=kv_blocks,
                         part_blocks=part_blocks, clock=clock)
    server.start()
    log.info("relay for decode engines on %s (transports: %s)", server.address,
             ", ".join(sorted(transports)))
    return PrefillParts(table, server, nixl)


def _served(settings: SideSettings, kv_cache: Any, shm: dict[str, Any] | None,
            ) -> tuple[dict[str, dict[str, Any]], Any]:
    """The transports a prefill side offers (always tcp, from the blocks in place)."""
    transports: dict[str, dict[str, Any]] = {"tcp": {}}
    if shm is not None:
        transports["shm"] = shm
    if on_device(kv_cache) and settings.kv_transport in ("auto", "cuda_ipc"):
        # Exported once; where CUDA IPC is refused the descriptor says why and decode
        # engines use tcp (staged through host memory) instead.
        transports["cuda_ipc"] = CudaIpcTransport().register(kv_cache)
    nixl = None
    if settings.kv_transport == "nixl":
        # One NIXL agent, the whole cache registered once; its metadata goes to each
        # decode engine in the HELLO reply.
        from kvrelay.relay.transports.nixl import NixlTransport

        nixl = NixlTransport()
        transports["nixl"] = nixl.register(kv_cache)
        if settings.secret is None:
            log.warning(NIXL_WITHOUT_SECRET)
    return transports, nixl


def build_decode_side(
    loads: KvLoads, settings: SideSettings, *, engine_id: str, compat: str, kv_cache: Any,
    kv_blocks: Any = None, layout: str = "block_major", kv_dtype: str = "",
    policy: Policy = Policy.RECOMPUTE,
    new_attempt: Callable[[], str] | None = None,
) -> DecodeParts:
    """A receiver over ``loads`` with its relay client(s) and transport. ``kv_cache``:
    the engine's cache (a tensor) or vLLM's regions; ``kv_blocks``: how tcp writes
    blocks when it is not the tensor itself (vLLM's regions)."""

    def client(transport: str) -> RelayClient:
        return RelayClient(compat=compat, transport=transport, client_id=engine_id,
                           layout=layout, kv_dtype=kv_dtype, secret=settings.secret,
                           io_timeout=settings.io_timeout)

    def tcp(c: RelayClient) -> TcpTransport:
        # A cache on a GPU is staged through pinned host buffers (staging.py).
        t = TcpTransport(None if kv_blocks is not None else kv_cache, connect=c.open_data,
                         io_timeout=settings.io_timeout)
        if kv_blocks is not None:
            t.blocks = kv_blocks
        return t

    def ipc(c: RelayClient) -> CudaIpcTransport:
        return CudaIpcTransport(kv_cache, fallback=tcp(c))

    kind = settings.kv_transport
    transport: Any
    link: Any
    if kind == "auto":
        # A local prefill engine: shm for a cache in host memory, cuda_ipc for one on a
        # GPU (tcp where IPC is refused); a remote one: tcp.
        local = "cuda_ipc" if on_device(kv_cache) else "shm"
        local_client, tcp_client = client(local), client("tcp")
        link, clients = AutoLink(local_client, tcp_client), [local_client, tcp_client]
        transport = AutoTransport(
            ipc(local_client) if local == "cuda_ipc" else ShmTransport(kv_cache),
            tcp(tcp_client))
    else:
        only = client(kind)
        link, clients = only, [only]
        if kind == "nixl":
            from kvrelay.relay.transports.nixl import NixlTransport

            transport = NixlTransport(kv_cache)  # one-sided READs; the fence decides
        elif kind == "cuda_ipc":
            transport = ipc(only)
        elif kind == "shm":
            transport = ShmTransport(kv_cache)
        else:
            transport = tcp(only)
    receiver = Receiver(
        loads, link, transport, holder=engine_id, compat=compat,
        config=ReceiverConfig(policy=policy, peer_timeout=settings.lease_timeout,
                              heartbeat_interval=max(0.05, settings.lease_timeout / 4),
                              copy_timeout=settings.lease_max,
                              not_yet_timeout=NOT_YET_TIMEOUT),
        **({"new_attempt": new_attempt} if new_attempt is not None else {}))
    return DecodeParts(receiver, clients, transport)
