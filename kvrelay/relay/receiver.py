"""The decode side: pull a request's KV from a prefill engine's lease, validate, commit.

One ``Load`` per remote request, in explicit phases:

    ADMITTING   queued in the engine; no blocks yet
    ACQUIRING   WAITING_FOR_KV: blocks allocated, ACQUIRE sent
    COPYING     LOADING: the transport writes into our blocks; heartbeats renew the lease
    DRAINING    aborted or failed while copying: the transport may still write, so
                the blocks stay until poll() says it stopped
    COMMITTING  copy finished, RELEASE(ok) sent: P's answer is the fence verdict
                (done = the lease was PULLING by us with unchanged generations)
    REPORTING   the outcome is decided here; telling P (RELEASE failed / ABORT)
    DONE

The fence: no decode before P answers RELEASE(ok) with ``done``. Any other answer,
or none within ``peer_timeout``, discards the copy and falls back per policy:
``recompute`` (prefill locally; the default) or ``fail`` (finish with a clear error).

P is told the outcome of a lease exactly once (``Load.told``): RELEASE(ok|failed) or
ABORT, also when the request is rejected before admission. Lost messages are
retransmitted with the same sequence number (P answers duplicates idempotently)
until ``peer_timeout``; after that P's own deadline releases the lease.

Pure: time comes in as ``now``; messages go out through ``link`` and replies come
back through ``on_reply``; the transport is an argument. Timers sit in a heap with
lazy invalidation (``Load.epoch``); only loads with a transfer running are polled.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.engine import Engine
from kvrelay.core.lifecycle import RequestState
from kvrelay.core.request import Request
from kvrelay.core.scheduler import RequestRejected
from kvrelay.relay import protocol as P
from kvrelay.relay.remote import RelayLink, RemoteKv
from kvrelay.relay.transports.base import TransferState, Transport
from kvrelay.sampling_params import SamplingParams

__all__ = [
    "INVALID_PARAMS", "Phase", "Policy", "Receiver", "ReceiverConfig", "RelayLink", "RemoteKv",
]

# Errors that start with this are the client's (forged, replayed or mismatched
# kv_transfer_params): the request fails whatever the policy, and the server
# answers 400 naming kv_transfer_params.
INVALID_PARAMS = "invalid kv_transfer_params: "


class Policy(enum.Enum):
    RECOMPUTE = "recompute"
    FAIL = "fail"


class Phase(enum.Enum):
    ADMITTING = "admitting"
    ACQUIRING = "acquiring"
    COPYING = "copying"
    DRAINING = "draining"
    COMMITTING = "committing"
    REPORTING = "reporting"
    DONE = "done"


@dataclass(frozen=True)
class ReceiverConfig:
    policy: Policy = Policy.RECOMPUTE
    rto: float = 0.5  # retransmit an unanswered message after this long
    peer_timeout: float = 30.0  # stop waiting for P's answer (its acquire deadline)
    copy_timeout: float = 60.0
    heartbeat_interval: float = 5.0


@dataclass
class ReceiverStats:
    transfer_bytes: int = 0
    transfer_seconds_sum: float = 0.0
    transfer_seconds_count: int = 0
    fence_failures: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)  # by reason
    stale_replies: int = 0
    loaded: int = 0


@dataclass(eq=False)
class Load:
    request_id: str
    kv: RemoteKv
    phase: Phase
    started: float
    msg: P.Request | None = None  # the outstanding request, resent until answered
    give_up_at: float = 0.0
    handle: Any = None
    generations: list[int] = field(default_factory=list)
    told: bool = False  # P has been sent this lease's outcome
    aborted: bool = False  # the client aborted while a transfer could still write
    fail_reason: str = ""  # why a draining transfer was stopped (empty: abort)
    epoch: int = 0  # bumps on every phase change; invalidates older timers
    seqs: list[int] = field(default_factory=list)


class Receiver:
    def __init__(
        self,
        engine: Engine,
        link: RelayLink,
        transport: Transport,
        *,
        holder: str,
        compat: str,
        config: ReceiverConfig | None = None,
        prefix_cached_blocks: Callable[[Request], int] = lambda req: 0,
    ) -> None:
        self.engine = engine
        self.link = link
        self.transport = transport
        self.holder = holder
        self.compat = compat
        self.config = config or ReceiverConfig()
        self.prefix_cached_blocks = prefix_cached_blocks
        self.stats = ReceiverStats()
        self.loads: dict[str, Load] = {}
        self._transfers: dict[str, Load] = {}  # COPYING or DRAINING: polled each tick
        self._by_seq: dict[int, tuple[Load, str, int]] = {}
        self._timers: list[tuple[float, int, Load, int]] = []
        self._seq = itertools.count(1)
        self._tie = itertools.count()

    # -- from the server / proxy -------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        kv: RemoteKv,
        now: float,
        *,
        eos_token_ids: Sequence[int] = (),
    ) -> Request:
        """Admit a request whose prompt KV waits in a lease. On rejection P is told
        (ABORT) at once and ``RequestRejected`` propagates to the caller."""
        load = Load(request_id, kv, Phase.ADMITTING, now)
        try:
            if kv.compat != self.compat:
                raise RequestRejected(
                    "kv_transfer_params",
                    f"the prefill engine's KV (compat {kv.compat}) does not fit this "
                    f"engine's model (compat {self.compat})",
                )
            if kv.num_tokens != len(prompt_token_ids):
                raise RequestRejected(
                    "kv_transfer_params",
                    f"the lease holds the KV of {kv.num_tokens} tokens, the prompt has "
                    f"{len(prompt_token_ids)}",
                )
            req = self.engine.add_request(
                request_id, prompt_token_ids, params, eos_token_ids=eos_token_ids,
                remote_kv=kv, first_token=kv.first_token,
            )
        except (RequestRejected, ValueError):
            self._tell(load, P.Abort(0, kv.engine_id, kv.lease_id), now, Phase.REPORTING)
            if load.phase is not Phase.DONE:
                self.loads.setdefault(f"rejected:{kv.lease_id}", load)
            raise
        self.loads[request_id] = load
        if req.state is RequestState.FINISHED:
            # The first token already completed the request: nothing to pull.
            self._tell(load, self._release_msg(load, True), now, Phase.REPORTING)
        return req

    def abort(self, request_id: str, now: float) -> bool:
        """A client abort (or cancel). Safe in any phase, and more than once."""
        aborted = self.engine.abort_request(request_id)
        load = self.loads.get(request_id)
        if load is None or not aborted:
            return aborted
        phase = load.phase
        if phase in (Phase.ADMITTING, Phase.ACQUIRING):
            # No transfer writes yet: the engine freed the blocks; tell P.
            self._tell(load, P.Abort(0, load.kv.engine_id, load.kv.lease_id), now,
                       Phase.REPORTING)
        elif phase is Phase.COPYING:
            load.aborted = True
            self.transport.cancel(load.handle)
            self._set_phase(load, Phase.DRAINING)
        elif phase is Phase.DRAINING:
            load.aborted = True
        elif phase is Phase.COMMITTING:
            # The copy has ended; the answer to RELEASE no longer matters to us.
            load.aborted = True
            self.engine.kv_transfer_ended(request_id)
        return aborted

    # -- events --------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for req in self.engine.take_kv_waiting():
            self._start(self.loads[req.request_id], req, now)
        for load in list(self._transfers.values()):
            self._poll(load, now)
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, load, epoch = heapq.heappop(timers)
            if epoch == load.epoch and load.phase is not Phase.DONE:
                self._on_timer(load, now)

    def next_wakeup(self) -> float | None:
        return self._timers[0][0] if self._timers else None

    def has_work(self) -> bool:
        return bool(self.loads)

    def on_reply(self, reply: P.Reply, now: float) -> None:
        entry = self._by_seq.pop(reply.seq, None)
        if entry is None:
            self.stats.stale_replies += 1
            return
        load, kind, epoch = entry
        if kind == "main" and epoch != load.epoch:
            self.stats.stale_replies += 1  # answers a message of an earlier phase
            return
        if kind == "heartbeat":
            if reply.status != "ok" and load.phase is Phase.COPYING:
                self._stop_copy(load, "lease_lost", now)
            return
        if load.phase is Phase.ACQUIRING:
            self._on_acquired(load, reply, now)
        elif load.phase is Phase.COMMITTING:
            self._on_committed(load, reply, now)
        elif load.phase is Phase.REPORTING:
            self._finish_load(load)
        else:
            self.stats.stale_replies += 1

    # -- phases --------------------------------------------------------------------
    def _start(self, load: Load, req: Request, now: float) -> None:
        kv = load.kv
        need = len(req.block_ids)
        if self.prefix_cached_blocks(req) >= need:
            # Race 8: nothing to pull; P is still told, so it frees at once.
            self.engine.kv_load_start(req.request_id)
            self.engine.kv_load_done(req.request_id)
            self._tell(load, P.Release(0, kv.engine_id, kv.lease_id, self.holder, True), now,
                       Phase.REPORTING)
            return
        self._set_phase(load, Phase.ACQUIRING)
        self._send(load, P.Acquire(0, kv.engine_id, kv.lease_id, self.holder), now)

    def _on_acquired(self, load: Load, reply: P.Reply, now: float) -> None:
        rid, kv = load.request_id, load.kv
        req = self.engine.requests[rid]
        need = len(req.block_ids)
        if reply.status != "ok":
            why = reply.error or reply.reason
            replayed = reply.status == "released" and reply.reason == "done"
            if replayed or (reply.status == "error" and "restarted" not in reply.error):
                # No such lease (forged params), or one already pulled (replayed
                # params): the client's error, nothing to fall back from.
                self._fallback(load, "invalid_params", f"{INVALID_PARAMS}{why}", fail=True)
            else:
                reason = "engine_restarted" if "restarted" in reply.error else "acquire_failed"
                self._fallback(load, reason, f"the KV lease could not be acquired: {why}")
            self._finish_load(load)  # the lease is gone (or not ours): nothing to tell
            return
        mismatch = self._mismatch(kv, reply, need)
        if mismatch:
            self._fallback(load, "invalid_params", f"{INVALID_PARAMS}{mismatch}", fail=True)
            self._tell(load, self._release_msg(load, False), now, Phase.REPORTING)
            return
        load.generations = list(reply.generations[:need])
        self.engine.kv_load_start(rid)
        peer = self.link.peer(kv.relay)
        load.handle = self.transport.read(peer, kv.lease_id, self.holder,
                                          reply.block_ids[:need], req.block_ids)
        self._set_phase(load, Phase.COPYING)
        load.give_up_at = now + self.config.copy_timeout
        self._timer(load, min(now + self.config.heartbeat_interval, load.give_up_at))
        self._transfers[rid] = load
        self._poll(load, now)

    def _poll(self, load: Load, now: float) -> None:
        status = self.transport.poll(load.handle)
        if status.state is TransferState.PENDING:
            return
        del self._transfers[load.request_id]
        rid = load.request_id
        if load.phase is Phase.COPYING and status.state is TransferState.DONE:
            self.stats.transfer_bytes += status.nbytes
            self.stats.transfer_seconds_sum += status.seconds
            self.stats.transfer_seconds_count += 1
            self._tell(load, self._release_msg(load, True), now, Phase.COMMITTING)
        elif load.phase is Phase.COPYING:
            self._fallback(load, "transfer_failed", status.error)
            self._tell(load, self._release_msg(load, False), now, Phase.REPORTING)
        elif load.aborted:  # DRAINING after an abort: the blocks may go now
            self.engine.kv_transfer_ended(rid)
            self._tell(load, P.Abort(0, load.kv.engine_id, load.kv.lease_id), now,
                       Phase.REPORTING)
        else:  # DRAINING after a failure
            self._fallback(load, load.fail_reason, f"KV transfer stopped: {load.fail_reason}")
            self._tell(load, self._release_msg(load, False), now, Phase.REPORTING)

    def _on_committed(self, load: Load, reply: P.Reply, now: float) -> None:
        if load.aborted:
            self._finish_load(load)
            return
        if reply.reason == "done" and reply.status in ("ok", "released"):
            self.engine.kv_load_done(load.request_id)
            self.stats.loaded += 1
        else:
            self.stats.fence_failures += 1
            why = reply.error or f"lease {reply.reason or 'lost'}"
            self._fallback(load, "fence_failed", f"the copied KV failed validation ({why})")
        self._finish_load(load)

    def _on_timer(self, load: Load, now: float) -> None:
        cfg = self.config
        if load.phase is Phase.COPYING:
            if now >= load.give_up_at:
                self._stop_copy(load, "transfer_timeout", now)
                return
            kv = load.kv
            self._send(load, P.Heartbeat(0, kv.engine_id, kv.lease_id, self.holder), now,
                       kind="heartbeat")
            self._timer(load, min(now + cfg.heartbeat_interval, load.give_up_at))
        elif now >= load.give_up_at:
            self._give_up(load)
        elif load.msg is not None:
            self.link.send(load.kv.relay, load.msg)
            self._timer(load, min(now + cfg.rto, load.give_up_at))

    def _give_up(self, load: Load) -> None:
        """P has not answered within peer_timeout: unreachable, crashed or restarted."""
        kv = load.kv
        if load.phase is Phase.ACQUIRING:
            self._fallback(load, "unreachable", f"the prefill engine at {kv.relay} did not "
                           f"answer within {self.config.peer_timeout:g} s")
            if not load.told:  # best effort; P's deadline frees the lease regardless
                load.told = True
                self.link.send(kv.relay, P.Abort(next(self._seq), kv.engine_id, kv.lease_id))
        elif load.phase is Phase.COMMITTING and not load.aborted:
            self.stats.fence_failures += 1
            self._fallback(load, "unreachable", "the prefill engine did not confirm the KV copy")
        self._finish_load(load)

    # -- helpers -------------------------------------------------------------------
    def _stop_copy(self, load: Load, reason: str, now: float) -> None:
        load.fail_reason = reason
        self.transport.cancel(load.handle)
        self._set_phase(load, Phase.DRAINING)
        self._poll(load, now)

    @staticmethod
    def _mismatch(kv: RemoteKv, reply: P.Reply, need: int) -> str:
        """Why the params the client sent disagree with the lease P holds ('' if not)."""
        if len(reply.block_ids) < need:
            return f"the lease holds {len(reply.block_ids)} blocks, the prompt needs {need}"
        if list(reply.block_ids[:need]) != list(kv.block_ids[:need]):
            return "block_ids do not match the lease"
        if reply.first_token != kv.first_token or reply.num_tokens != kv.num_tokens:
            return "first_token or num_tokens do not match the lease"
        return ""

    def _fallback(self, load: Load, reason: str, error: str, *, fail: bool = False) -> None:
        self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1
        recompute = self.config.policy is Policy.RECOMPUTE and not fail
        self.engine.kv_load_failed(load.request_id, error, recompute=recompute)

    def _release_msg(self, load: Load, ok: bool) -> P.Release:
        kv = load.kv
        gens = load.generations if ok and load.generations else None  # None: no copy
        return P.Release(0, kv.engine_id, kv.lease_id, self.holder, ok, gens)

    def _tell(self, load: Load, msg: P.Release | P.Abort, now: float, phase: Phase) -> None:
        """Send the lease's one outcome."""
        if load.told:
            raise AssertionError(f"lease {load.kv.lease_id}: outcome told twice")
        load.told = True
        self._set_phase(load, phase)
        self._send(load, msg, now)

    def _send(self, load: Load, msg: P.Request, now: float, kind: str = "main") -> None:
        seq = next(self._seq)
        msg.seq = seq
        self._by_seq[seq] = (load, kind, load.epoch)
        load.seqs.append(seq)
        if kind == "main":
            load.msg = msg
            load.give_up_at = now + self.config.peer_timeout
            self._timer(load, now + self.config.rto)
        self.link.send(load.kv.relay, msg)

    def _set_phase(self, load: Load, phase: Phase) -> None:
        load.phase = phase
        load.epoch += 1
        load.msg = None

    def _timer(self, load: Load, when: float) -> None:
        heapq.heappush(self._timers, (when, next(self._tie), load, load.epoch))

    def _finish_load(self, load: Load) -> None:
        self._set_phase(load, Phase.DONE)
        for seq in load.seqs:
            self._by_seq.pop(seq, None)
        self._transfers.pop(load.request_id, None)
        if self.loads.get(load.request_id) is load:
            del self.loads[load.request_id]
        else:
            self.loads.pop(f"rejected:{load.kv.lease_id}", None)
