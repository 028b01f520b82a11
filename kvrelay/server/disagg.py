"""The prefill and decode roles: what each adds to the engine loop.

Prefill (``--role prefill``): the KV cache lives in shared memory (for the shm
transport; a cache on a GPU is exported through CUDA IPC instead) and a relay server
answers decode engines. A request with
``kv_transfer_params: {"do_remote_decode": true}`` is prefilled, samples its first
token and finishes with ``remote_decode``; once the in-flight fence has moved its
blocks to a lease, its output carries the lease as ``kv_transfer_params``.

Decode (``--role decode``): a request with the lease in ``kv_transfer_params`` is
admitted through the relay receiver, which pulls and validates the KV, then the
engine decodes from the first token. Replies from prefill engines arrive on the
relay client's queue and are applied in the loop thread, before each step.

Both roles serve requests without ``kv_transfer_params`` as a colocated engine.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool
from kvrelay.core.engine import Engine, RequestOutput
from kvrelay.core.kv_port import EngineKvLoads, PoolLeaseBlocks
from kvrelay.core.lifecycle import FinishReason
from kvrelay.model.interface import LoadedModel
from kvrelay.relay.client import RelayClient
from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.metrics import Family, decode_metrics, prefill_metrics
from kvrelay.relay.receiver import Policy, Receiver, ReceiverConfig
from kvrelay.relay.server import RelayServer, RelayServerConfig
from kvrelay.relay.transports.auto import AutoLink, AutoTransport
from kvrelay.relay.transports.base import on_device
from kvrelay.relay.transports.cuda_ipc import CudaIpcTransport
from kvrelay.relay.transports.shm import ShmKvCache, ShmTransport
from kvrelay.relay.transports.tcp import TcpTransport, block_io
from kvrelay.server.engine_loop import LoopHooks, _Add

log = logging.getLogger(__name__)


class PrefillHooks(LoopHooks):
    def __init__(self, server: RelayServer) -> None:
        self.server = server
        self.lock = server.lock
        # Finished (remote_decode) outputs whose blocks are not handed over yet: an
        # in-flight step still referenced them. Delivered after the hand-off.
        self._held: dict[str, RequestOutput] = {}
        self.nixl: Any = None  # the NIXL agent (it must live as long as the relay)

    def route(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        ready: list[RequestOutput] = []
        params = self.server.kv_params
        for out in outputs:
            if out.finish_reason is FinishReason.REMOTE_DECODE:
                self._held[out.request_id] = out
            else:
                ready.append(out)
        # Only outputs held for their fence: a handful, never a scan of requests.
        for rid in [r for r in self._held if r in params]:
            out = self._held.pop(rid)
            out.kv_transfer_params = params.pop(rid).to_dict()
            ready.append(out)
        return ready

    def busy(self) -> bool:
        return bool(self._held)

    def release(self, engine_id: str, lease_id: str) -> dict[str, Any]:
        """The proxy's ``/v1/kv/release``: the client went away before the decode
        engine had the request. Answered like any relay message (stale: counted)."""
        with self.lock:
            ans = self.server.table.abort(engine_id, lease_id, time.monotonic())
        return {"status": ans.status.value, "reason": ans.reason.value if ans.reason else None,
                "error": ans.error or None}

    def metrics(self) -> list[Family]:
        with self.lock:
            return prefill_metrics(self.server.table, self.server)

    def drain_pending(self) -> str | None:
        # The relay keeps serving while draining: each lease ends by its pull, its
        # release by the proxy, or its expiry (the relay's expiry thread).
        with self.lock:
            active = self.server.table.leases_by_state()
        if not sum(active.values()):
            return None
        return f"{active['held']} leases held and {active['pulling']} being pulled"

    def exit_summary(self) -> str:
        with self.lock:
            stats = self.server.table.stats
            released = ", ".join(f"{k} {v}" for k, v in sorted(stats.released.items()))
            held = sum(stats.active.values())
        return (f"; leases: {stats.created} created, {sum(stats.released.values())} released "
                f"({released or 'none'}), {held} still held")


class DecodeHooks(LoopHooks):
    def __init__(self, receiver: Receiver, clients: list[RelayClient]) -> None:
        self.receiver = receiver
        self.clients = clients
        self.lock = threading.Lock()  # guards metrics reads against the loop thread

    def busy(self) -> bool:
        return self.receiver.has_work()

    def add(self, engine: Engine, cmd: _Add) -> None:
        if cmd.remote_kv is None:
            super().add(engine, cmd)
            return
        self.receiver.submit(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.remote_kv,
                             time.monotonic(), eos_token_ids=cmd.eos_token_ids)

    def abort(self, engine: Engine, request_id: str, reason: FinishReason) -> None:
        if request_id in self.receiver.loads:
            self.receiver.abort(request_id, time.monotonic())
        else:
            engine.abort_request(request_id, reason)

    def before_step(self) -> None:
        now = time.monotonic()
        for client in self.clients:
            while True:
                try:
                    self.receiver.on_reply(client.replies.get_nowait(), now)
                except queue.Empty:
                    break
        self.receiver.tick(now)

    def metrics(self) -> list[Family]:
        with self.lock:
            return decode_metrics(self.receiver,
                                  sum(c.sender_threads for c in self.clients))


@dataclass(eq=False)
class RelayExport:
    """Reads relay samples for /metrics (a prometheus custom collector)."""

    hooks: PrefillHooks | DecodeHooks

    def collect(self) -> Any:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        for f in self.hooks.metrics():
            if f.kind == "histogram":
                buckets = [("+Inf" if b == float("inf") else repr(b), n) for b, n in f.buckets]
                yield HistogramMetricFamily(f.name, f.help, buckets=buckets, sum_value=f.total)
                continue
            family: Any = kinds[f.kind](f.name, f.help, labels=list(f.labels))
            for key, value in f.samples.items():
                family.add_metric(list(key), value)
            yield family


def new_engine_id() -> str:
    """Unique per process life: a restarted engine rejects leases of its previous one."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def build_prefill(
    args: Any, config: SchedulerConfig, model: LoadedModel, shm: ShmKvCache | None
) -> tuple[Engine, PrefillHooks]:
    pool = BlockPool(config.num_blocks)
    table = LeaseTable(PoolLeaseBlocks(pool), engine_id=new_engine_id(),
                       acquire_timeout=args.lease_timeout, hard_cap=args.lease_max)
    transports: dict[str, dict[str, Any]] = {"tcp": {}}
    if shm is not None:
        transports["shm"] = shm.descriptor()
    check_transport(args.kv_transport, model.kv_cache)
    if on_device(model.kv_cache) and args.kv_transport in ("auto", "cuda_ipc"):
        # Exported once; where CUDA IPC is refused the descriptor says why and decode
        # engines use tcp (staged through host memory) instead.
        transports["cuda_ipc"] = CudaIpcTransport().register(model.kv_cache)
    nixl = None
    if args.kv_transport == "nixl":
        # One NIXL agent, the whole cache registered once; its metadata goes to each
        # decode engine in the HELLO reply.
        from kvrelay.relay.transports.nixl import NixlTransport

        nixl = NixlTransport()
        transports["nixl"] = nixl.register(model.kv_cache)
        if not args.relay_secret:
            log.warning("--kv-transport nixl without --relay-secret: any peer that reaches "
                        "the relay port gets the NIXL metadata, with which it can read "
                        "this engine's whole KV cache")
    cfg = RelayServerConfig(
        compat=model.kv_geometry.compat_hash(model.name), host=args.relay_host,
        port=args.relay_port, secret=_secret(args), transports=transports,
        # A decode engine that takes longer than its lease timeout to read a reply or
        # a stream has lost the lease anyway; idle connections outlive its heartbeats.
        send_timeout=args.lease_timeout, idle_timeout=max(120.0, 2 * args.lease_timeout),
    )
    server = RelayServer(table, threading.Lock(), cfg, kv_blocks=block_io(model.kv_cache))
    server.start()
    # Registered after the CLI's shm.close, so it runs first: no read outlives the cache.
    atexit.register(server.close)
    log.info("relay for decode engines on %s (transports: %s)", server.address,
             ", ".join(sorted(transports)))
    engine = Engine(config, model.runner, pool=pool, kv_handoff=server.kv_handoff)
    hooks = PrefillHooks(server)
    hooks.nixl = nixl
    return engine, hooks


def build_decode(
    args: Any, config: SchedulerConfig, model: LoadedModel
) -> tuple[Engine, DecodeHooks]:
    engine = Engine(config, model.runner)
    engine_id = new_engine_id()
    compat = model.kv_geometry.compat_hash(model.name)

    # Every socket wait of the decode side is bounded by half the lease timeout, so a
    # frozen or cut-off prefill engine makes it fall back within --lease-timeout.
    io_timeout = args.lease_timeout / 2

    def client(transport: str) -> RelayClient:
        return RelayClient(compat=compat, transport=transport, client_id=engine_id,
                           secret=_secret(args), io_timeout=io_timeout)

    def tcp(c: RelayClient) -> TcpTransport:
        # A cache on a GPU is staged through pinned host buffers (staging.py).
        return TcpTransport(model.kv_cache, connect=c.open_data, io_timeout=io_timeout)

    def ipc(c: RelayClient) -> CudaIpcTransport:
        return CudaIpcTransport(model.kv_cache, fallback=tcp(c))

    check_transport(args.kv_transport, model.kv_cache)
    transport: Any
    if args.kv_transport == "auto":
        # A local prefill engine: shm for a cache in host memory, cuda_ipc for one on a
        # GPU (tcp where IPC is refused); a remote one: tcp.
        local = "cuda_ipc" if on_device(model.kv_cache) else "shm"
        local_client, tcp_client = client(local), client("tcp")
        link: Any = AutoLink(local_client, tcp_client)
        clients = [local_client, tcp_client]
        transport = AutoTransport(
            ipc(local_client) if local == "cuda_ipc" else ShmTransport(model.kv_cache),
            tcp(tcp_client))
    else:
        only = client(args.kv_transport)
        link, clients = only, [only]
        if args.kv_transport == "nixl":
            from kvrelay.relay.transports.nixl import NixlTransport

            transport = NixlTransport(model.kv_cache)
        elif args.kv_transport == "cuda_ipc":
            transport = ipc(only)
        else:
            transport = (ShmTransport(model.kv_cache) if args.kv_transport == "shm"
                         else tcp(only))
    receiver = Receiver(
        EngineKvLoads(engine), link, transport, holder=engine_id, compat=compat,
        config=ReceiverConfig(
            policy=Policy(args.kv_load_failure_policy), peer_timeout=args.lease_timeout,
            heartbeat_interval=max(0.05, args.lease_timeout / 4),
            copy_timeout=args.lease_max,
        ),
    )
    return engine, DecodeHooks(receiver, clients)


def check_transport(kv_transport: str, kv_cache: Any) -> None:
    """A transport that cannot serve this cache: an error naming the flag."""
    if kv_transport == "shm" and on_device(kv_cache):
        raise ValueError(f"--kv-transport shm needs a KV cache in host memory (--device "
                         f"cpu); this one is on {kv_cache.device}: use auto, cuda_ipc or tcp")
    if kv_transport == "cuda_ipc" and not on_device(kv_cache):
        raise ValueError("--kv-transport cuda_ipc needs a KV cache on a CUDA device "
                         "(--device cuda); use auto, shm or tcp")


def _secret(args: Any) -> bytes | None:
    return args.relay_secret.encode() if args.relay_secret else None
