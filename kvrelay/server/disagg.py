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
from kvrelay.relay.metrics import Family, decode_metrics, prefill_metrics
from kvrelay.relay.receiver import Policy, Receiver
from kvrelay.relay.server import RelayServer
from kvrelay.relay.sides import (
    SideSettings,
    build_decode_side,
    build_prefill_side,
    check_transport,
)
from kvrelay.relay.transports.shm import ShmKvCache
from kvrelay.relay.transports.tcp import block_io
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
            out.lease = params.pop(rid)
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


def side_settings(args: Any) -> SideSettings:
    return SideSettings(
        kv_transport=args.kv_transport, lease_timeout=args.lease_timeout,
        lease_max=args.lease_max, secret=args.relay_secret.encode() if args.relay_secret
        else None, relay_host=getattr(args, "relay_host", "127.0.0.1"),
        relay_port=getattr(args, "relay_port", 0))


def build_prefill(
    args: Any, config: SchedulerConfig, model: LoadedModel, shm: ShmKvCache | None
) -> tuple[Engine, PrefillHooks]:
    pool = BlockPool(config.num_blocks)
    check_transport(args.kv_transport, model.kv_cache)
    side = build_prefill_side(
        PoolLeaseBlocks(pool), side_settings(args), engine_id=new_engine_id(),
        compat=model.kv_geometry.compat_hash(model.name), kv_cache=model.kv_cache,
        kv_blocks=block_io(model.kv_cache), kv_dtype=model.kv_geometry.dtype,
        shm=shm.descriptor() if shm is not None else None)
    # Registered after the CLI's shm.close, so it runs first: no read outlives the cache.
    atexit.register(side.server.close)
    engine = Engine(config, model.runner, pool=pool, kv_handoff=side.server.kv_handoff)
    hooks = PrefillHooks(side.server)
    hooks.nixl = side.nixl
    return engine, hooks


def build_decode(
    args: Any, config: SchedulerConfig, model: LoadedModel
) -> tuple[Engine, DecodeHooks]:
    engine = Engine(config, model.runner)
    check_transport(args.kv_transport, model.kv_cache)
    side = build_decode_side(
        EngineKvLoads(engine), side_settings(args), engine_id=new_engine_id(),
        compat=model.kv_geometry.compat_hash(model.name), kv_cache=model.kv_cache,
        kv_dtype=model.kv_geometry.dtype, policy=Policy(args.kv_load_failure_policy))
    return engine, DecodeHooks(side.receiver, side.clients)
