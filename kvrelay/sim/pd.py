"""Deterministic simulation of a prefill/decode pair: `python -m kvrelay.sim pd --seeds N`.

One seed draws a scenario (clients, network faults, transfer speed and failures,
deadlines, fallback policy, async scheduling on either side, aborts by client,
prefill and decode, decode crashes, prefill restarts) and runs it on a simulated
clock until nothing is left to happen. After every event:

- both pools pass ``check_integrity`` and the lease table owns exactly its blocks;
- the runners never sample on KV slots that do not hold the request's own KV
  (the fence: a torn copy must never be decoded);
- a transfer never writes into a block its request no longer owns (DRAINING);
- no client request ends twice, and any that ends with tokens has exactly the
  colocated engine's tokens.

Prefix caching is on in both engines (the servers' default). In about half the
seeds the clients' prompts share a prefix (drawn from a second generator, so the
scenario's other draws stay as they were): P shares cached blocks between requests
and leases, and evicts them under pressure; D shares the prompt blocks it has cached
and pulls only the rest (partial pulls), with aborts, faults and evictions landing
while such pulls are in flight.

At quiescence: every client request ended once; both pools are free or cached;
every lease was released once (created == released); no load or request is left.
A failing seed prints its replay command.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.lifecycle import RequestState
from kvrelay.relay import protocol as P
from kvrelay.relay.receiver import Phase, Policy, ReceiverConfig
from kvrelay.sampling_params import SamplingParams
from kvrelay.sim.pd_nodes import VOCAB, Client, DecodeNode, PrefillNode, Proxy
from kvrelay.sim.pd_world import NetFaults, SimClock, SimKv, SimNetwork, Violation
from kvrelay.testing.fake_runner import expected_output

MAX_SIM_TIME = 300.0
MAX_EVENTS = 20_000  # a seed averages under 100 events; far more means it is stuck
LINK_DELAY = 0.001


@dataclass
class SimConfig:
    n_clients: int = 3
    p_blocks: int = 24
    d_blocks: int = 24
    p_async: bool = False
    d_async: bool = False
    p_step: float = 0.01
    d_step: float = 0.01
    acquire_timeout: float = 2.0
    hard_cap: float = 8.0
    per_block: float = 0.005
    transfer_fail: float = 0.0
    transfer_stall: float = 0.0  # a transfer stuck mid-copy, deaf to cancel for a while
    transfer_throw: float = 0.0  # the transport raises when asked to start a read
    step_fault: float = 0.0  # a model step raises (its requests fail, the engine goes on)
    # client index -> (delay after its params reach the proxy, to the other D?) replays
    replays: dict[int, list[tuple[float, bool]]] = field(default_factory=dict)
    faults: NetFaults = field(default_factory=NetFaults)
    receiver: ReceiverConfig = field(default_factory=ReceiverConfig)
    # (time, kind, client index) for kind in client_abort, prefill_abort, decode_abort;
    # (time, kind, -1) for decode_crash, prefill_restart
    incidents: list[tuple[float, str, int]] = field(default_factory=list)


def draw_config(rng: random.Random) -> SimConfig:
    acquire = rng.choice([0.2, 0.5, 1.0, 3.0])
    faults = NetFaults(
        drop=rng.choice([0.0, 0.0, 0.05, 0.2]),
        dup=rng.choice([0.0, 0.1, 0.3]),
        jitter=rng.choice([0.002, 0.02, 0.1]),
        slow=rng.choice([0.0, 0.0, 0.05]),
    )
    if rng.random() < 0.1:  # a half-open link: messages vanish for a while
        start = rng.uniform(0.0, 2.0)
        faults.blackholes.append((start, start + rng.choice([0.3, 1.0, 5.0])))
    recv = ReceiverConfig(
        policy=Policy.FAIL if rng.random() < 0.2 else Policy.RECOMPUTE,
        rto=rng.choice([0.05, 0.2]),
        peer_timeout=rng.choice([0.5, 2.0, 4.0]),
        copy_timeout=rng.choice([0.5, 3.0]),
        heartbeat_interval=acquire * rng.choice([0.3, 0.9, 2.0]),
        drain_timeout=rng.choice([0.5, 5.0]),
    )
    n = rng.randint(1, 5)
    incidents: list[tuple[float, str, int]] = []
    for i in range(n):
        for kind, prob in (("client_abort", 0.2), ("prefill_abort", 0.05),
                           ("decode_abort", 0.05)):
            if rng.random() < prob:
                incidents.append((rng.uniform(0.0, 1.5), kind, i))
    replays: dict[int, list[tuple[float, bool]]] = {}
    for i in range(n):
        if rng.random() < 0.15:
            replays[i] = [(rng.choice([0.0, 0.002, 0.02, 0.5]), rng.random() < 0.3)
                          for _ in range(rng.randint(1, 2))]
    for kind, prob in (("decode_crash", 0.08), ("prefill_restart", 0.08)):
        if rng.random() < prob:
            incidents.append((rng.uniform(0.0, 1.5), kind, -1))
    return SimConfig(
        n_clients=n, p_async=rng.random() < 0.5, d_async=rng.random() < 0.5,
        p_step=rng.choice([0.002, 0.01, 0.05]), d_step=rng.choice([0.002, 0.01, 0.05]),
        acquire_timeout=acquire, hard_cap=acquire * rng.choice([2, 5]),
        per_block=rng.choice([0.0005, 0.005, 0.05, 0.4]),
        transfer_fail=rng.choice([0.0, 0.0, 0.1, 0.4]), faults=faults, receiver=recv,
        transfer_stall=rng.choice([0.0, 0.0, 0.0, 0.2]),
        transfer_throw=rng.choice([0.0, 0.0, 0.0, 0.1]),
        step_fault=rng.choice([0.0, 0.0, 0.0, 0.03]),
        incidents=incidents, replays=replays,
    )


class World:
    def __init__(self, seed: int, cfg: SimConfig | None = None, trace: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.cfg = cfg if cfg is not None else draw_config(self.rng)
        self.clock = SimClock()
        self.net = SimNetwork(self.clock, self.rng, self.cfg.faults)
        self.trace: list[str] | None = [] if trace else None
        self._kv_by_life: dict[int, SimKv] = {}
        self.p = self._new_prefill(0)
        self.d = DecodeNode(self, 0)
        self.d2 = DecodeNode(self, 0, name="x")  # where some replays go
        self.proxy = Proxy(self)
        self.clients: dict[str, Client] = {}
        self.leases_created = 0
        # Clients' prompts start with this many common tokens (prefix-cache hits).
        share_rng = random.Random(seed ^ 0x5EED)
        self.shared_prefix = share_rng.choice([0, 0, 4, 8, 12, 20])
        # Aborts that found a partial pull in flight (coverage, not an invariant).
        self.partial_pull_aborts = 0

    # -- wiring used by the nodes --------------------------------------------------
    def prefill_kv(self, life: int) -> SimKv | None:
        return self._kv_by_life.get(life)

    def step_fault(self) -> bool:
        return self.cfg.step_fault > 0 and self.rng.random() < self.cfg.step_fault

    def proxy_later(self, fn: Callable[[], None]) -> None:
        self.clock.after(LINK_DELAY, fn)

    def relay_deliver(self, msg: P.Request, sender: DecodeNode | None) -> None:
        """A relay message reaches whatever prefill engine listens at the address now."""
        reply = self.p.handle(msg)
        lease = getattr(msg, "lease_id", "")[:8]
        self.log(f"relay {type(msg).__name__} {lease} -> {reply.status} {reply.reason} "
                 f"{reply.error}".rstrip())
        if sender is not None:
            self.net.deliver(lambda: sender.on_reply(reply))

    def log(self, text: str) -> None:
        if self.trace is not None:
            self.trace.append(f"{self.clock.now:9.4f} {text}")

    # -- scenario ------------------------------------------------------------------
    def add_client(self, idx: int, prompt_len: int, max_tokens: int, at: float,
                   local: bool = False) -> Client:
        seed = self.seed * 64 + idx
        prompt = [(seed + 7 * i) % VOCAB for i in range(prompt_len)]
        shared = min(prompt_len, self.shared_prefix)
        prompt[:shared] = [(self.seed + 5 * i) % VOCAB for i in range(shared)]
        c = Client(idx, f"c{idx}", prompt, SamplingParams(max_tokens=max_tokens, seed=seed),
                   expected_output(seed, prompt_len, max_tokens, VOCAB), local=local)
        self.clients[c.rid] = c
        self.clock.at(at, lambda: self.proxy.start(c))
        return c

    def incident(self, at: float, kind: str, idx: int = -1) -> None:
        self.clock.at(at, lambda: self._incident(kind, idx))

    def _incident(self, kind: str, idx: int) -> None:
        self.log(f"incident {kind} {idx}")
        c = self.clients.get(f"c{idx}")
        load = self.d.receiver.loads.get(c.rid) if c is not None else None
        if (load is not None and load.first_block and kind.endswith("_abort")
                and load.phase in (Phase.ACQUIRING, Phase.COPYING)):
            self.partial_pull_aborts += 1
        if kind == "client_abort" and c is not None:
            self.proxy.client_abort(c)
        elif kind == "prefill_abort" and c is not None:
            self.p.abort(c.rid)
        elif kind == "decode_abort" and c is not None:
            self.d.abort(c.rid)
        elif kind == "decode_crash":
            self._crash_decode()
        elif kind == "prefill_restart":
            self._restart_prefill()

    def _crash_decode(self) -> None:
        old = self.d
        old.alive = False
        old.transport.alive = False
        for c in self.clients.values():
            if c.stage == "d" and not c.on_other:
                self.proxy.fail(c, "error: decode engine crashed")
        self.d = DecodeNode(self, old.life + 1)

    def _restart_prefill(self) -> None:
        old = self.p
        old.alive = False
        self.leases_created += old.table.stats.created
        del self._kv_by_life[old.life]
        for c in self.clients.values():
            if c.stage == "p":
                self.proxy.fail(c, "error: prefill engine restarted")
        self.p = self._new_prefill(old.life + 1)

    def _new_prefill(self, life: int) -> PrefillNode:
        node = PrefillNode(self, life)
        self._kv_by_life[life] = node.kv
        return node

    # -- running -------------------------------------------------------------------
    def run(self) -> None:
        events = 0
        while self.clock.run_next():
            self.check_invariants()
            events += 1
            if self.clock.now > MAX_SIM_TIME or events > MAX_EVENTS:
                raise Violation(f"no quiescence after {events} events, "
                                f"{self.clock.now:g} simulated seconds")
        self.check_quiescence()

    def check_invariants(self) -> None:
        self.p.pool.check_integrity()
        self.p.table.check_integrity()
        for d in (self.d, self.d2):
            d.pool.check_integrity()
            d.engine.scheduler.check_accounts()
            d.receiver.check_integrity(functools.partial(_state_of, d.engine.requests))

    def check_quiescence(self) -> None:
        for c in self.clients.values():
            if c.ends != 1:
                raise Violation(f"{c.rid} ended {c.ends} times (stage {c.stage})")
        p, d = self.p, self.d
        if p.pool.num_in_use or p.table.leases:
            raise Violation(f"prefill pool not free at quiescence: {p.pool.owners()}")
        created = p.table.stats.created
        released = sum(p.table.stats.released.values())
        if created != released:
            raise Violation(f"{created} leases created, {released} released")
        for d in (self.d, self.d2):
            if (d.pool.num_in_use or d.engine.requests
                    or d.receiver.has_work()):
                raise Violation(f"decode side not idle at quiescence: {d.pool.owners()} "
                                f"{list(d.engine.requests)} {list(d.receiver.loads)}")


def _state_of(requests: dict[str, Any], request_id: str) -> RequestState | None:
    req = requests.get(request_id)
    return req.state if req is not None else None


def build_world(seed: int, trace: bool = False) -> World:
    w = World(seed, trace=trace)
    rng = w.rng
    for i in range(w.cfg.n_clients):
        long_tail = rng.random() < 0.1  # too long for the decode engine: rejected
        w.add_client(i, rng.randint(1, 20), 30 if long_tail else rng.randint(1, 6),
                     rng.uniform(0.0, 0.5))
    # Prefill-only traffic: it reuses blocks that leases free, so a copy racing an
    # expiry really reads another request's KV (a torn copy the fence must catch).
    for i in range(w.cfg.n_clients, w.cfg.n_clients + rng.randint(0, 4)):
        w.add_client(i, rng.randint(4, 24), rng.randint(1, 20), rng.uniform(0.0, 3.0),
                     local=True)
    for at, kind, idx in w.cfg.incidents:
        w.incident(at, kind, idx)
    return w


def run_seed(seed: int, trace: bool = False) -> tuple[str | None, World]:
    """Run one seed; return (violation or None, the world)."""
    w = build_world(seed, trace)
    try:
        w.run()
    except Violation as e:
        return f"{type(e).__name__}: {e}", w
    except Exception as e:  # a crash inside the core is a violation too
        return f"{type(e).__name__}: {e}", w
    return None, w


def run_pd(seeds: Sequence[int] | range, *, verbose: bool = False,
           out: Callable[[str], Any] = print) -> int:
    """Run the seeds; print each failure with its replay command; return violations."""
    violations = 0
    t0 = time.perf_counter()
    for seed in seeds:
        err, _ = run_seed(seed)
        if err is not None:
            violations += 1
            out(f"seed {seed}: {err}")
            out(f"  replay: python -m kvrelay.sim pd --seed {seed} --trace")
        elif verbose:
            out(f"seed {seed}: ok")
    dt = time.perf_counter() - t0
    n = len(seeds)
    out(f"{dt:.1f} s, {n / max(dt, 1e-9):.0f} seeds/s")
    out(f"{n} seeds, {violations} violations")
    return violations


def add_pd_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("pd", help="simulate prefill/decode KV hand-over under faults")
    p.add_argument("--seeds", type=int, default=1000, help="run seeds 0..N-1")
    p.add_argument("--start", type=int, default=0, help="first seed")
    p.add_argument("--seed", type=int, default=None, help="replay one seed")
    p.add_argument("--trace", action="store_true", help="print the replayed seed's trace")
    p.set_defaults(func=pd_command)
    return p


def pd_command(args: argparse.Namespace) -> int:
    if args.seed is not None:
        err, w = run_seed(args.seed, trace=args.trace)
        for line in w.trace or []:
            print(line)
        print(f"seed {args.seed}: {err or 'ok'}")
        return 1 if err else 0
    return 1 if run_pd(range(args.start, args.start + args.seeds)) else 0
