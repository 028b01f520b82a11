"""The prefill node, the decode node and the proxy of the pd simulation.

Each node wraps the production objects (Engine, LeaseTable, PrefillRelay, Receiver)
and only adds the simulated I/O around them: relay messages through the faulty
``SimNetwork``, proxy <-> engine traffic over reliable, ordered links (HTTP over
TCP), steps and timers on the ``SimClock``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool
from kvrelay.core.engine import Engine, RequestOutput
from kvrelay.core.kv_port import EngineKvLoads, PoolLeaseBlocks
from kvrelay.core.lifecycle import FinishReason
from kvrelay.core.scheduler import RequestRejected
from kvrelay.relay import protocol as P
from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.prefill import KvTransferParams, PrefillRelay
from kvrelay.relay.receiver import Receiver, RemoteKv
from kvrelay.relay.transports.base import PeerInfo
from kvrelay.sampling_params import SamplingParams
from kvrelay.sim.pd_world import (
    SimClock,
    SimKv,
    SimNetwork,
    SimRunner,
    SimTransport,
    Violation,
    run_step,
)

COMPAT = "sim-compat"
VOCAB = 997
BLOCK = 4
LINK_DELAY = 0.001  # proxy <-> engine (reliable, ordered)


def busy(engine: Engine) -> bool:
    s = engine.scheduler
    return bool(s.waiting or s.running or engine._in_flight)


class World(Protocol):
    """What the nodes use of the simulated world (kvrelay.sim.pd.World builds it)."""

    cfg: Any  # kvrelay.sim.pd.SimConfig
    clients: dict[str, Client]
    clock: SimClock
    net: SimNetwork
    rng: random.Random

    @property
    def p(self) -> PrefillNode: ...
    @property
    def d(self) -> DecodeNode: ...
    @property
    def d2(self) -> DecodeNode: ...
    @property
    def proxy(self) -> Proxy: ...
    def prefill_kv(self, life: int) -> SimKv | None: ...
    def step_fault(self) -> bool: ...
    def proxy_later(self, fn: Callable[[], None]) -> None: ...
    def relay_deliver(self, msg: P.Request, sender: DecodeNode | None) -> None: ...
    def log(self, text: str) -> None: ...


@dataclass(eq=False)
class Client:
    idx: int
    rid: str
    prompt: list[int]
    params: SamplingParams
    expect: list[int]
    stage: str = "new"  # new -> p -> d -> done
    tokens: list[int] = field(default_factory=list)
    result: str = ""  # "tokens" | "error: ..." | "aborted"
    ends: int = 0
    lease: KvTransferParams | None = None
    local: bool = False  # served by the prefill engine alone (traffic that reuses blocks)
    on_other: bool = False  # a replay sent to the second decode engine


class PrefillNode:
    def __init__(self, w: World, life: int) -> None:
        self.w, self.life = w, life
        self.alive = True
        c = w.cfg
        self.pool = BlockPool(c.p_blocks)
        self.kv = SimKv(c.p_blocks, BLOCK)
        rng = w.rng
        self.table = LeaseTable(PoolLeaseBlocks(self.pool), engine_id=f"p{life}",
                                acquire_timeout=c.acquire_timeout, hard_cap=c.hard_cap,
                                new_lease_id=lambda: f"{rng.getrandbits(128):032x}")
        self.relay = PrefillRelay(self.table, address="p", compat=COMPAT,
                                  clock=lambda: w.clock.now)
        cfg = SchedulerConfig(num_blocks=c.p_blocks, block_size=BLOCK, max_model_len=64,
                              max_num_batched_tokens=32, async_scheduling=c.p_async,
                              enable_prefix_caching=True)
        self.engine = Engine(cfg, SimRunner(self.kv, self.pool, VOCAB, fault=w.step_fault),
                             pool=self.pool,
                             kv_handoff=self.relay.kv_handoff)
        self._step_pending = False
        self._expiry_at: float | None = None

    def submit(self, c: Client) -> None:
        try:
            self.engine.add_request(c.rid, c.prompt, c.params, remote_decode=not c.local)
        except RequestRejected as e:
            msg = f"error: prefill rejected: {e}"
            self.w.proxy_later(lambda: self.w.proxy.fail(c, msg))
            return
        self.kick()

    def abort(self, rid: str) -> None:
        self.engine.abort_request(rid)
        self.kick()

    def handle(self, msg: P.Request) -> P.Reply:
        reply = self.relay.handle(msg, self.w.clock.now)
        self.arm_expiry()
        self.kick()  # freed blocks may admit waiting requests
        return reply

    def kick(self) -> None:
        if self.alive and not self._step_pending and busy(self.engine):
            self._step_pending = True
            self.w.clock.after(self.w.cfg.p_step, self._step)

    def _step(self) -> None:
        self._step_pending = False
        if not self.alive:
            return
        for out in run_step(self.engine):
            c = self.w.clients[out.request_id]
            if c.local and out.finish_reason is not FinishReason.ABORT:
                self.w.proxy_later(self._streamed_later(c, out))
            elif out.finished:
                self._finished(out)
        self.arm_expiry()
        self.kick()

    def _streamed_later(self, c: Client, out: RequestOutput) -> Callable[[], None]:
        return lambda: self.w.proxy.decoded(c, out)

    def _finished(self, out: RequestOutput) -> None:
        w = self.w
        w.log(f"p{self.life} out {out.request_id} {out.new_token_ids} {out.finish_reason}")
        c = w.clients[out.request_id]
        if out.finish_reason is FinishReason.REMOTE_DECODE:
            params = self.relay.kv_params.pop(out.request_id)
            w.proxy_later(lambda: w.proxy.prefilled(c, params))
        elif out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP):
            toks = list(out.new_token_ids)
            w.proxy_later(lambda: w.proxy.finished_at_prefill(c, toks))
        else:
            why = out.error or (out.finish_reason.value if out.finish_reason else "?")
            w.proxy_later(lambda: w.proxy.fail(c, f"error: prefill ended: {why}"))

    def arm_expiry(self) -> None:
        nxt = self.table.next_deadline()
        if nxt is not None and (self._expiry_at is None or nxt < self._expiry_at):
            self._expiry_at = nxt
            self.w.clock.at(nxt, self._expire)

    def _expire(self) -> None:
        if not self.alive:
            return
        self._expiry_at = None
        if self.table.expire(self.w.clock.now):
            self.kick()
        self.arm_expiry()


class DecodeNode:
    def __init__(self, w: World, life: int, name: str = "d") -> None:
        self.w, self.life, self.name = w, life, name
        self.alive = True
        c = w.cfg
        self.pool = BlockPool(c.d_blocks)
        self.kv = SimKv(c.d_blocks, BLOCK)
        cfg = SchedulerConfig(num_blocks=c.d_blocks, block_size=BLOCK, max_model_len=32,
                              max_num_batched_tokens=32, async_scheduling=c.d_async,
                              enable_prefix_caching=True)
        self.engine = Engine(cfg, SimRunner(self.kv, self.pool, VOCAB, fault=w.step_fault),
                             pool=self.pool)
        self.transport = SimTransport(
            w.clock, w.rng, source=w.prefill_kv, prefill_life=lambda: w.p.life,
            dest=self.kv, dest_pool=self.pool, on_change=self.poke,
            per_block=c.per_block, fail_prob=c.transfer_fail, stall_prob=c.transfer_stall,
            throw_prob=c.transfer_throw,
        )
        rng = w.rng
        self.receiver = Receiver(EngineKvLoads(self.engine), self, self.transport,
                                 holder=f"{name}{life}", compat=COMPAT, config=c.receiver,
                                 new_attempt=lambda: f"{rng.getrandbits(64):016x}")
        self._step_pending = False
        self._wake_at: float | None = None

    # RelayLink
    def send(self, relay: str, msg: P.Request) -> None:
        w = self.w
        w.net.deliver(lambda: w.relay_deliver(msg, self))

    def peer(self, relay: str) -> PeerInfo:
        return PeerInfo("p", self.w.p.table.engine_id)

    def trusted(self, relay: str) -> bool:
        return True  # the simulated cluster's only relay

    def on_reply(self, reply: P.Reply) -> None:
        if self.alive:
            self.receiver.on_reply(reply, self.w.clock.now)
            self.poke()

    def submit(self, c: Client, kv: RemoteKv) -> None:
        w = self.w
        w.log(f"{self.name}{self.life} submit {c.rid} lease {kv.lease_id[:8]}")
        try:
            self.receiver.submit(c.rid, c.prompt, c.params, kv, w.clock.now)
        except RequestRejected as e:
            msg = f"error: decode rejected: {e}"
            w.proxy_later(lambda: w.proxy.fail(c, msg))
        self.poke()

    def abort(self, rid: str) -> None:
        if self.alive:
            self.receiver.abort(rid, self.w.clock.now)
            self.poke()

    def poke(self) -> None:
        if not self.alive:
            return
        w = self.w
        self.receiver.tick(w.clock.now)
        # Outputs decided outside a step (a load that failed with policy fail).
        for out in self.engine.take_outputs():
            w.proxy_later(self._decoded_later(out))
        if not self._step_pending and busy(self.engine):
            self._step_pending = True
            w.clock.after(w.cfg.d_step, self._step)
        nxt = self.receiver.next_wakeup()
        if nxt is not None and (self._wake_at is None or nxt < self._wake_at):
            self._wake_at = nxt
            w.clock.at(nxt, self._wake)

    def _wake(self) -> None:
        self._wake_at = None
        self.poke()

    def _step(self) -> None:
        self._step_pending = False
        if not self.alive:
            return
        for out in run_step(self.engine):
            self.w.log(f"{self.name}{self.life} out {out.request_id} {out.new_token_ids} "
                       f"{out.finish_reason} {out.error or ''}")
            self.w.proxy_later(self._decoded_later(out))
        self.poke()

    def _decoded_later(self, out: RequestOutput) -> Callable[[], None]:
        c = self.w.clients[out.request_id]
        return lambda: self.w.proxy.decoded(c, out)


class Proxy:
    """The proxy's logic: prefill first, first token to the client, then decode."""

    def __init__(self, w: World) -> None:
        self.w = w

    def start(self, c: Client) -> None:
        if c.stage == "done":  # aborted before it was sent
            return
        c.stage = "p"
        p = self.w.p
        self.w.proxy_later(lambda: p.submit(c) if p.alive else self.fail(c, "error: no prefill"))

    def prefilled(self, c: Client, params: KvTransferParams) -> None:
        w = self.w
        c.lease = params
        if c.stage == "done":  # the client left: free the lease now
            w.net.deliver(lambda: w.relay_deliver(
                P.Abort(0, params.engine_id, params.lease_id, "", ""), None))
            return
        if params.first_token != c.expect[0]:
            raise Violation(f"{c.rid}: first token {params.first_token} != {c.expect[0]}")
        c.tokens = [params.first_token]
        c.stage = "d"
        w.log(f"proxy {c.rid} prefilled, lease {params.lease_id[:8]} -> decode")
        d = w.d
        kv = RemoteKv.from_dict(params.to_dict())
        w.proxy_later(lambda: d.submit(c, kv) if d.alive else self._decode_gone(c, params))
        for k, (delay, other) in enumerate(w.cfg.replays.get(c.idx, [])):
            w.clock.after(delay, functools.partial(self.replay, c, kv, k, other))

    def replay(self, c: Client, kv: RemoteKv, k: int, other: bool) -> None:
        """The same params again (a client retry or a replay), to the same decode engine
        or another one. It may be refused, or succeed where the first failed; if it
        answers tokens they must be the colocated ones (Client.end checks)."""
        w = self.w
        r = Client(c.idx, f"{c.rid}r{k}", c.prompt, c.params, c.expect, stage="d",
                   tokens=[kv.first_token], on_other=other)
        w.clients[r.rid] = r
        d = w.d2 if other else w.d
        w.log(f"proxy replays {c.rid} as {r.rid} to {d.name}")
        if d.alive:
            d.submit(r, kv)
        else:
            self.fail(r, "error: decode engine unavailable")

    def _decode_gone(self, c: Client, params: KvTransferParams) -> None:
        w = self.w
        w.net.deliver(lambda: w.relay_deliver(
            P.Abort(0, params.engine_id, params.lease_id, "", ""), None))
        self.fail(c, "error: decode engine unavailable")

    def finished_at_prefill(self, c: Client, tokens: list[int]) -> None:
        if c.stage != "done":
            c.tokens = tokens
            self.end(c, "tokens")

    def decoded(self, c: Client, out: RequestOutput) -> None:
        if c.stage == "done":
            return
        c.tokens.extend(out.new_token_ids)
        if out.finished:
            if out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP):
                self.end(c, "tokens")
            else:
                self.fail(c, f"error: decode ended: {out.error or out.finish_reason}")

    def client_abort(self, c: Client) -> None:
        if c.stage == "done":
            return
        w = self.w
        if c.stage == "p":
            p = w.p
            w.proxy_later(lambda: p.abort(c.rid) if p.alive else None)
        elif c.stage == "d":
            d = w.d
            w.proxy_later(lambda: d.abort(c.rid))
        self.end(c, "aborted")

    def fail(self, c: Client, result: str) -> None:
        if c.stage != "done":  # else: a late failure of a request the client left
            self.end(c, result)

    def end(self, c: Client, result: str) -> None:
        self.w.log(f"client {c.rid} ends: {result}")
        c.ends += 1
        if c.ends > 1:
            raise Violation(f"{c.rid} ended twice: {c.result!r} then {result!r}")
        c.stage, c.result = "done", result
        if result == "tokens" and c.tokens != c.expect:
            raise Violation(f"{c.rid}: tokens {c.tokens} != colocated {c.expect}")

