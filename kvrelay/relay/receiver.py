"""The decode side: pull a request's KV from a prefill engine's lease, validate, commit.

One ``Load`` per remote request attempt, in explicit phases (``PHASE_TRANSITIONS``):

    ADMITTING   queued in the engine; no blocks yet
    ACQUIRING   WAITING_FOR_KV: blocks allocated, ACQUIRE sent
    COPYING     LOADING: the transport writes into our blocks; heartbeats renew the lease
    DRAINING    aborted or failed while copying (a transfer that failed but may still
                write polls PENDING with an error): the transport may still write, so
                the blocks stay until poll() says it stopped, or until ``drain_timeout``
                passes: then they move to a quarantine owner (never reused while a
                copy may write; they return when the transport finally reports)
    COMMITTING  copy finished, RELEASE(ok) sent: P's answer is the fence verdict
                (done = the lease was still ours, pulled by this attempt, with the
                pool's generations unchanged)
    REPORTING   the outcome is decided here; telling P (RELEASE failed / ABORT)
    DONE

Each attempt carries a fresh nonce (``attempt``): a lease is a capability of one
attempt, so the same params sent twice (a retry, a replay) can never make a second
request decode on KV it did not validate itself. The fence: no decode before P
answers this attempt's RELEASE(ok) with ``ok``/``done``. Any other answer, or none
within ``peer_timeout``, discards the copy and falls back per policy: ``recompute``
(prefill locally; the default) or ``fail`` (finish with a clear error). Params that
are the client's error (no such lease, a lease another attempt holds or consumed,
params that disagree with the lease) fail whatever the policy (HTTP 400).

P is told the outcome of a lease exactly once (``Load.told``): RELEASE(ok|failed) or
ABORT, also when the request is rejected before admission. Lost messages are
retransmitted with the same sequence number (P answers duplicates idempotently)
until ``peer_timeout``; after that P's own deadline releases the lease. While
copying, heartbeats that get no answer for ``peer_timeout`` stop the copy (a frozen
P), so every wait here has a bound.

Pure: time comes in as ``now``; messages go out through ``link`` and replies come
back through ``on_reply``; the transport is an argument; the engine is reached only
through the ``KvLoads`` port. Timers sit in a heap with lazy invalidation
(``Load.epoch``); only loads with a transfer running are polled.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import itertools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.relay import protocol as P
from kvrelay.relay.port import Failure, KvLoads, RequestRejected, RequestState
from kvrelay.relay.remote import RelayLink, RemoteKv
from kvrelay.relay.transports.base import TransferState, TransferStatus, Transport
from kvrelay.sampling_params import SamplingParams

__all__ = [
    "INVALID_PARAMS", "Phase", "Policy", "Receiver", "ReceiverConfig", "RelayLink", "RemoteKv",
]

# Errors that start with this are the client's (forged, replayed or mismatched
# kv_transfer_params): the request fails whatever the policy, and the server
# answers 400 naming kv_transfer_params.
INVALID_PARAMS = "invalid kv_transfer_params: "

E = P.ErrorCode
# Refusals of ACQUIRE that are the client's error, and their fallback reason.
_CLIENT_ERRORS = {E.UNKNOWN_LEASE, E.LEASE_BUSY, E.NOT_HOLDER}
# Refusals that say nothing about the params: fall back per policy, with this reason.
_PEER_REASONS = {
    E.WRONG_ENGINE: "engine_restarted",
    E.AUTH_FAILED: "auth_failed",
    E.REFUSED: "refused",
    E.UNREACHABLE: "unreachable",
    E.NOT_YET: "lease_not_made",
}


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


Ph, S = Phase, RequestState
PHASE_TRANSITIONS: frozenset[tuple[Phase, Phase]] = frozenset({
    (Ph.ADMITTING, Ph.ACQUIRING),
    (Ph.ADMITTING, Ph.REPORTING),  # rejected, aborted, finished by its first token
    (Ph.ACQUIRING, Ph.COPYING),
    (Ph.ACQUIRING, Ph.COMMITTING),  # every block cached: nothing to copy
    (Ph.ACQUIRING, Ph.REPORTING),  # aborted, or params that disagree with the lease
    (Ph.ACQUIRING, Ph.DONE),  # the lease is gone or not ours: nothing to tell P
    (Ph.COPYING, Ph.DRAINING),  # aborted, or stopped (lease lost, timeout, frozen P)
    (Ph.COPYING, Ph.COMMITTING),
    (Ph.COPYING, Ph.REPORTING),  # the transfer failed on its own: it writes no more
    (Ph.DRAINING, Ph.REPORTING),  # the transfer stopped, or its blocks were quarantined
    (Ph.COMMITTING, Ph.DONE),
    (Ph.REPORTING, Ph.DONE),
})

# The request states each phase allows (None: the request is gone from the engine).
PHASE_REQUEST_STATES: dict[Phase, frozenset[RequestState | None]] = {
    Ph.ADMITTING: frozenset({S.WAITING, S.WAITING_FOR_KV}),
    Ph.ACQUIRING: frozenset({S.WAITING_FOR_KV}),
    Ph.COPYING: frozenset({S.LOADING}),
    Ph.DRAINING: frozenset({S.LOADING, S.DRAINING}),
    # Aborted meanwhile: the copy had ended, the request may already be released.
    Ph.COMMITTING: frozenset({S.LOADING, S.FINISHING, None}),
    Ph.REPORTING: frozenset(RequestState) | {None},
    Ph.DONE: frozenset(RequestState) | {None},
}
del Ph, S


class IllegalPhase(RuntimeError):
    pass


@dataclass(frozen=True)
class ReceiverConfig:
    policy: Policy = Policy.RECOMPUTE
    rto: float = 0.5  # retransmit an unanswered message after this long
    peer_timeout: float = 30.0  # stop waiting for P's answer (its acquire deadline)
    copy_timeout: float = 60.0
    heartbeat_interval: float = 5.0
    drain_timeout: float = 10.0  # a cancelled transfer must stop writing within this
    # P answers NOT_YET for a lease it named but has not made (vLLM's prefill makes it a
    # step after the params left): ACQUIRE is asked again, backing off, until this long
    # after the first; then the load falls back and P is told ABORT (it frees the lease
    # the moment it makes it).
    not_yet_timeout: float = 10.0


NOT_YET_MAX_GAP = 0.02  # the longest wait between two ACQUIREs that met NOT_YET

TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                            2.5, 5.0, 10.0, 30.0, float("inf"))


@dataclass
class ReceiverStats:
    transfer_bytes: int = 0
    # Completed pulls and their bytes by the transport that carried them (auto and
    # cuda_ipc name the one they chose: shm, cuda_ipc or tcp).
    bytes_by_transport: dict[str, int] = field(default_factory=dict)
    pulls_by_transport: dict[str, int] = field(default_factory=dict)
    # Completed pulls by duration: a count per TRANSFER_SECONDS_BUCKETS bound.
    transfer_seconds_buckets: list[int] = field(
        default_factory=lambda: [0] * len(TRANSFER_SECONDS_BUCKETS))
    transfer_seconds_sum: float = 0.0
    fence_failures: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)  # by reason
    stale_replies: int = 0
    loaded: int = 0
    # Prompt blocks found in this engine's prefix cache: not pulled (partial pulls).
    cached_blocks: int = 0
    quarantined_blocks: int = 0  # blocks held for transfers that overran drain_timeout
    not_yet: int = 0  # ACQUIREs answered NOT_YET (the lease was named, not made yet)


@dataclass(eq=False)
class Load:
    request_id: str
    kv: RemoteKv
    phase: Phase
    started: float
    attempt: str = ""
    msg: P.Request | None = None  # the outstanding request, resent until answered
    give_up_at: float = 0.0
    heard_at: float = 0.0  # last reply from P about this load (heartbeats included)
    handle: Any = None
    local_blocks: list[int] = field(default_factory=list)
    first_block: int = 0  # leading blocks found in our prefix cache: not pulled
    prompt_digest: bytes = b""  # protocol.prompt_digest of the request's prompt
    told: bool = False  # P has been sent this lease's outcome
    not_yet: int = 0  # ACQUIREs P answered NOT_YET
    aborted: bool = False  # the client aborted while a transfer could still write
    fail_reason: str = ""  # why a draining transfer was stopped (empty: abort)
    epoch: int = 0  # bumps on every phase change; invalidates older timers
    seqs: list[int] = field(default_factory=list)
    # When each step happened (``now``): acquire (sent), acquired, copied (the receiver
    # saw the transfer done), committed; and the transfer's final status.
    marks: dict[str, float] = field(default_factory=dict)
    transfer: TransferStatus | None = None


class Receiver:
    def __init__(
        self,
        loads: KvLoads,
        link: RelayLink,
        transport: Transport,
        *,
        holder: str,
        compat: str,
        config: ReceiverConfig | None = None,
        new_attempt: Callable[[], str] = lambda: secrets.token_hex(8),
    ) -> None:
        self.engine = loads
        self.link = link
        self.transport = transport
        self.holder = holder
        self.compat = compat
        self.config = config or ReceiverConfig()
        self.new_attempt = new_attempt
        self.stats = ReceiverStats()
        self.loads: dict[str, Load] = {}
        self._transfers: dict[str, Load] = {}  # COPYING or DRAINING: polled each tick
        # Transfers that overran drain_timeout: (load, its quarantined blocks).
        self._quarantine: dict[int, tuple[Load, list[int]]] = {}
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
    ) -> None:
        """Admit a request whose prompt KV waits in a lease. On rejection P is told
        (ABORT) at once and ``RequestRejected`` propagates to the caller."""
        load = Load(request_id, kv, Phase.ADMITTING, now, attempt=self.new_attempt(),
                    heard_at=now, prompt_digest=P.prompt_digest(prompt_token_ids))
        try:
            if kv.compat != self.compat:
                raise RequestRejected(
                    "kv_transfer_params",
                    f"the prefill engine's KV (compat {kv.compat}) does not fit this "
                    f"engine's model (compat {self.compat}): the two differ in model, "
                    f"dtype, KV cache dtype, block size or layout",
                )
            if kv.num_tokens != len(prompt_token_ids):
                raise RequestRejected(
                    "kv_transfer_params",
                    f"the lease holds the KV of {kv.num_tokens} tokens, the prompt has "
                    f"{len(prompt_token_ids)}",
                )
            finished = self.engine.admit(
                request_id, prompt_token_ids, params, eos_token_ids=eos_token_ids,
                remote_kv=kv, first_token=kv.first_token,
            )
        except (RequestRejected, ValueError):
            self._tell(load, self._abort_msg(load), now, Phase.REPORTING)
            if load.phase is not Phase.DONE:
                self.loads.setdefault(f"rejected:{load.attempt}", load)
            raise
        self.loads[request_id] = load
        if finished:
            # The first token already completed the request: nothing to pull.
            self._tell(load, self._release_msg(load, True), now, Phase.REPORTING)

    def abort(self, request_id: str, now: float) -> bool:
        """A client abort (or cancel). Safe in any phase, and more than once."""
        aborted = self.engine.abort(request_id)
        load = self.loads.get(request_id)
        if load is None or not aborted:
            return aborted
        phase = load.phase
        if phase in (Phase.ADMITTING, Phase.ACQUIRING):
            # No transfer writes yet: the engine freed the blocks; tell P.
            self._tell(load, self._abort_msg(load), now, Phase.REPORTING)
        elif phase is Phase.COPYING:
            load.aborted = True
            self.transport.cancel(load.handle)
            self._drain(load, now)
        elif phase is Phase.DRAINING:
            load.aborted = True
        elif phase is Phase.COMMITTING:
            # The copy has ended; the answer to RELEASE no longer matters to us.
            load.aborted = True
            self.engine.transfer_ended(request_id)
        return aborted

    def fail(self, request_id: str, reason: str, error: str, now: float) -> None:
        """Fail a load from outside (the code driving it hit an error), the way the
        receiver's own failures end: before a transfer, fall back and tell P; while
        copying, stop the copy first (drained, or quarantined). A load already ending
        (draining, committing, reporting) is left to end."""
        load = self.loads.get(request_id)
        if load is None:
            return
        if load.phase in (Phase.ADMITTING, Phase.ACQUIRING):
            self._fallback(load, reason, error)
            self._tell(load, self._abort_msg(load), now, Phase.REPORTING)
        elif load.phase is Phase.COPYING:
            self._stop_copy(load, reason, now)

    def owner(self, seq: int) -> str:
        """The request a reply's sequence number belongs to ('' if none)."""
        entry = self._by_seq.get(seq)
        return entry[0].request_id if entry is not None else ""

    # -- events --------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for request_id, block_ids, cached in self.engine.take_waiting():
            self._start(self.loads[request_id], block_ids, cached, now)
        for load in list(self._transfers.values()):
            self._poll(load, now)
        for key, (load, blocks) in list(self._quarantine.items()):
            if self.transport.poll(load.handle).state is not TransferState.PENDING:
                del self._quarantine[key]
                self.stats.quarantined_blocks -= len(blocks)
                self.engine.unquarantine(load.request_id, blocks)
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, load, epoch = heapq.heappop(timers)
            if epoch == load.epoch and load.phase is not Phase.DONE:
                self._on_timer(load, now)

    def timing(self, request_id: str) -> dict[str, float]:
        """Where a load's time went, in ms (only the steps it reached). ``acquire``:
        ACQUIRE sent to answered. ``read``: the READ started to the receiver seeing it
        done (the span of a one-sided READ alone), of which ``first_byte`` (tcp: P's
        answer to the READ), ``bytes`` (first byte to the last one landed in our blocks:
        the scatter is the receive itself) and ``noticed`` (landed to seen here); ``own``: the
        READ by the transport's own clock, where it keeps one (nixl: NIXL's, as vLLM's
        NixlConnector reports its READs; the rest of ``read`` is Python's share).
        ``commit``: RELEASE(ok) sent to P's verdict (0 when the READ carried the commit
        and the verdict came with the bytes: tcp). ``load``: ACQUIRE answered to the
        verdict, the span reported as the load time. The transfer's own clock marks its
        start and end: a ``now`` passed in may predate a READ posted within its call."""
        load = self.loads.get(request_id)
        if load is None:
            return {}
        m, st, out = load.marks, load.transfer, {}
        if "acquire" in m and "acquired" in m:
            out["acquire"] = 1000 * (m["acquired"] - m["acquire"])
        seen = m.get("copied")
        if st is not None and st.ended_at and seen is not None:
            seen = max(seen, st.ended_at)
            out["read"] = 1000 * (seen - (st.ended_at - st.seconds))
            if st.own_seconds:
                out["own"] = 1000 * st.own_seconds
            if st.first_byte:
                out["first_byte"] = 1000 * st.first_byte
                out["bytes"] = 1000 * (st.seconds - st.first_byte)
            out["noticed"] = 1000 * (seen - st.ended_at)
        if seen is not None and "committed" in m:
            out["commit"] = 1000 * (m["committed"] - seen)
        if "acquired" in m and "committed" in m:
            out["load"] = 1000 * (m["committed"] - m["acquired"])
        return out

    def next_wakeup(self) -> float | None:
        return self._timers[0][0] if self._timers else None

    def has_work(self) -> bool:
        return bool(self.loads) or bool(self._quarantine)

    def polling(self) -> bool:
        """A transfer is running (or quarantined): only ``tick`` sees it end, unless
        the transport wakes the caller itself. Replies and timers need no polling."""
        return bool(self._transfers) or bool(self._quarantine)

    def on_reply(self, reply: P.Reply, now: float) -> None:
        entry = self._by_seq.get(reply.seq)
        if entry is None or (reply.relay and reply.relay != entry[0].kv.relay):
            # Unknown, or another relay answering this load's sequence number (seqs
            # are guessable): a forged verdict must never settle a load.
            self.stats.stale_replies += 1
            return
        del self._by_seq[reply.seq]
        load, kind, epoch = entry
        load.heard_at = now
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

    def check_integrity(self, state_of: Callable[[str], RequestState | None]) -> None:
        """Every load's phase agrees with its request's state (``state_of``: None when
        the engine has released the request). O(loads): a check, not a hot path."""
        for key, load in self.loads.items():
            state = state_of(load.request_id) if not key.startswith("rejected:") else None
            if state not in PHASE_REQUEST_STATES[load.phase]:
                raise AssertionError(
                    f"load {load.request_id}: phase {load.phase.value} with request "
                    f"state {state.value if state else None}"
                )

    # -- phases --------------------------------------------------------------------
    def _start(self, load: Load, block_ids: list[int], cached: int, now: float) -> None:
        """``cached``: the leading blocks our prefix cache already holds. Only the rest
        is pulled: ACQUIRE names the first block wanted, and P releases the others.
        With every block cached (race 8) the lease is still acquired: its answer checks
        the params (first token, length) before we decode, and P frees at once."""
        load.local_blocks = block_ids
        load.first_block = cached
        self.stats.cached_blocks += cached
        self._set_phase(load, Phase.ACQUIRING)
        load.marks["acquire"] = now
        self._send_acquire(load, now)

    def _send_acquire(self, load: Load, now: float) -> None:
        kv = load.kv
        self._send(load, P.Acquire(0, kv.engine_id, kv.lease_id, self.holder, load.attempt,
                                   load.first_block), now)

    def _on_acquired(self, load: Load, reply: P.Reply, now: float) -> None:
        rid, kv = load.request_id, load.kv
        first, need = load.first_block, len(load.local_blocks)
        if reply.code == E.NOT_YET.value:
            if now < load.marks["acquire"] + self.config.not_yet_timeout:
                # Asked again shortly (2, 4, 8, 16, then every 20 ms: the lease is made
                # when P's worker starts its next step); the epoch bump drops this
                # round's retransmit timer.
                load.not_yet += 1
                self.stats.not_yet += 1
                load.epoch += 1
                load.msg = None
                self._timer(load, now + min(NOT_YET_MAX_GAP, 0.001 * 2 ** load.not_yet))
                return
            self._on_refused(load, reply)
            load.told = True  # best effort: P frees the lease the moment it makes it
            msg = self._abort_msg(load)
            msg.seq = next(self._seq)
            self.link.send(kv.relay, msg)
            self._finish_load(load)
            return
        if reply.status != "ok":
            self._on_refused(load, reply)
            self._finish_load(load)  # the lease is gone (or not ours): nothing to tell
            return
        mismatch = self._mismatch(load, reply)
        if mismatch:
            self._fallback(load, "invalid_params", f"{INVALID_PARAMS}{mismatch}",
                           client_error=True)
            self._tell(load, self._release_msg(load, False), now, Phase.REPORTING)
            return
        load.marks["acquired"] = now
        self.engine.load_started(rid)
        if first == need:  # everything cached: an empty copy, committed like any other
            self._tell(load, self._release_msg(load, True), now, Phase.COMMITTING)
            return
        try:
            peer = self.link.peer(kv.relay)
            # The reply names the lease's range from ``first`` on: ours are the same.
            load.handle = self.transport.read(peer, kv.lease_id, self.holder,
                                              reply.block_ids[:need - first],
                                              load.local_blocks[first:], attempt=load.attempt)
        except Exception as exc:  # no transfer started: nothing writes into our blocks
            self._fallback(load, "transfer_failed", f"the KV transfer could not start: {exc}")
            self._tell(load, self._release_msg(load, False), now, Phase.REPORTING)
            return
        self._set_phase(load, Phase.COPYING)
        load.give_up_at = now + self.config.copy_timeout
        self._timer(load, min(now + self.config.heartbeat_interval, load.give_up_at))
        self._transfers[rid] = load
        self._poll(load, now)

    def _on_refused(self, load: Load, reply: P.Reply) -> None:
        why = reply.error or reply.reason
        code = _code(reply.code)
        if reply.status == "released" and reply.reason == "done":
            self._fallback(load, "invalid_params",
                           f"{INVALID_PARAMS}lease already consumed ({why})",
                           client_error=True)
        elif code in _CLIENT_ERRORS:
            self._fallback(load, "invalid_params", f"{INVALID_PARAMS}{why}", client_error=True)
        else:  # released before any commit (expired, aborted, failed), or a peer refusal
            reason = _PEER_REASONS.get(code, "acquire_failed") if code else "acquire_failed"
            self._fallback(load, reason, f"the KV lease could not be acquired: {why}")

    def _poll(self, load: Load, now: float) -> None:
        status = self.transport.poll(load.handle)
        if status.state is TransferState.PENDING:
            if status.error and load.phase is Phase.COPYING:
                # Failed, but it may still write (a NIXL READ with a failed part): fall
                # back now; its blocks stay quarantined until the transport says it ended.
                self._stop_copy(load, "transfer_failed", now)
            return
        del self._transfers[load.request_id]
        rid = load.request_id
        if load.phase is Phase.COPYING and status.state is TransferState.DONE:
            load.marks["copied"], load.transfer = now, status
            self.stats.transfer_bytes += status.nbytes
            st = self.stats
            name = self._transport_name(load.handle)
            st.bytes_by_transport[name] = st.bytes_by_transport.get(name, 0) + status.nbytes
            st.pulls_by_transport[name] = st.pulls_by_transport.get(name, 0) + 1
            st.transfer_seconds_sum += status.seconds
            st.transfer_seconds_buckets[bisect.bisect_left(TRANSFER_SECONDS_BUCKETS,
                                                           status.seconds)] += 1
            if status.verdict is None:
                self._tell(load, self._release_msg(load, True), now, Phase.COMMITTING)
            else:  # the READ carried this attempt's RELEASE(ok); P's verdict came with it
                load.told = True
                self._set_phase(load, Phase.COMMITTING)
                self._on_committed(load, status.verdict, now)
        elif load.phase is Phase.COPYING:
            self._fallback(load, "transfer_failed", status.error)
            self._tell(load, self._release_msg(load, False), now, Phase.REPORTING)
        elif load.aborted:  # DRAINING after an abort: the blocks may go now
            self.engine.transfer_ended(rid)
            self._tell(load, self._abort_msg(load), now, Phase.REPORTING)
        else:  # DRAINING after a failure
            self._fallback(load, load.fail_reason, f"KV transfer stopped: {load.fail_reason}")
            self._tell(load, self._release_msg(load, False), now, Phase.REPORTING)

    def _on_committed(self, load: Load, reply: P.Reply, now: float) -> None:
        if load.aborted:
            self._finish_load(load)
            return
        # Only P's "ok, done" to this attempt's own RELEASE(ok) commits the copy.
        if reply.status == "ok" and reply.reason == "done":
            load.marks["committed"] = now
            # Pulled KV is shared (published) only if its relay is a proven one: a
            # forged relay's KV stays private to the request that named it.
            kv = load.kv
            shareable = load.first_block == len(load.local_blocks) or self.link.trusted(
                kv.relay)
            self.engine.load_done(load.request_id, shareable=shareable)
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
            elif now >= load.heard_at + cfg.peer_timeout:
                # Heartbeats unanswered: P is frozen or cut off; its lease will expire.
                self._stop_copy(load, "unreachable", now)
            else:
                kv = load.kv
                self._send(load, P.Heartbeat(0, kv.engine_id, kv.lease_id, self.holder,
                                             load.attempt), now, kind="heartbeat")
                nxt = min(now + cfg.heartbeat_interval, load.give_up_at,
                          load.heard_at + cfg.peer_timeout)
                self._timer(load, nxt)
        elif load.phase is Phase.DRAINING:
            self._quarantine_blocks(load, now)
        elif load.phase is Phase.ACQUIRING and load.msg is None:
            self._send_acquire(load, now)  # P said NOT_YET: ask again
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
                msg = self._abort_msg(load)
                msg.seq = next(self._seq)
                self.link.send(kv.relay, msg)
        elif load.phase is Phase.COMMITTING and not load.aborted:
            self.stats.fence_failures += 1
            self._fallback(load, "unreachable", "the prefill engine did not confirm the KV copy")
        self._finish_load(load)

    # -- helpers -------------------------------------------------------------------
    def _transport_name(self, handle: Any) -> str:
        """The transport that carried ``handle``: a transport that chooses per peer
        (auto, cuda_ipc with its fallback) says which with ``name_of``."""
        name_of = getattr(self.transport, "name_of", None)
        return str(name_of(handle)) if name_of is not None else str(
            getattr(self.transport, "name", "unknown"))

    def _stop_copy(self, load: Load, reason: str, now: float) -> None:
        """The copy failed (lease lost, timeout, P unreachable). The request does not
        wait for the transport to stop writing: if it has not stopped at once, its
        blocks are quarantined now and the request falls back on fresh blocks."""
        load.fail_reason = reason
        self.transport.cancel(load.handle)
        self._drain(load, now)
        if self.transport.poll(load.handle).state is TransferState.PENDING:
            self._quarantine_blocks(load, now)
        else:
            self._poll(load, now)

    def _drain(self, load: Load, now: float) -> None:
        self._set_phase(load, Phase.DRAINING)
        self._timer(load, now + self.config.drain_timeout)

    def _quarantine_blocks(self, load: Load, now: float) -> None:
        """The cancelled transfer has not stopped within drain_timeout: its blocks move
        to a quarantine owner, and the load ends as if the transfer had stopped."""
        del self._transfers[load.request_id]
        blocks = self.engine.quarantine(load.request_id)
        self._quarantine[id(load)] = (load, blocks)
        self.stats.quarantined_blocks += len(blocks)
        if load.aborted:
            self.engine.transfer_ended(load.request_id)
            self._tell(load, self._abort_msg(load), now, Phase.REPORTING)
        else:
            why = f"{load.fail_reason}; the transfer did not stop, its blocks are quarantined"
            self._fallback(load, load.fail_reason, f"KV transfer stopped: {why}")
            self._tell(load, self._release_msg(load, False), now, Phase.REPORTING)

    @staticmethod
    def _mismatch(load: Load, reply: P.Reply) -> str:
        """Why the request and its params disagree with the lease P holds ('' if not).
        The reply covers the lease's blocks from ``first`` (the partial pull) on. The
        lease must hold the KV of this very prompt: a genuine lease of another prompt of
        the same length would otherwise decode, and be published under this prompt's
        hashes in the prefix cache (poisoning every later request with its prefix)."""
        kv, first, need = load.kv, load.first_block, len(load.local_blocks)
        if reply.prompt_digest != load.prompt_digest:
            return "the lease holds the KV of another prompt"
        if len(reply.block_ids) < need - first:
            return (f"the lease holds {first + len(reply.block_ids)} blocks, the prompt "
                    f"needs {need}")
        if list(reply.block_ids[:need - first]) != list(kv.block_ids[first:need]):
            return "block_ids do not match the lease"
        if reply.first_token != kv.first_token or reply.num_tokens != kv.num_tokens:
            return "first_token or num_tokens do not match the lease"
        return ""

    def _fallback(self, load: Load, reason: str, error: str, *,
                  client_error: bool = False) -> None:
        """The load's one failure: recompute or fail by the policy; ``client_error``
        (params that name no KV this engine may pull) always fails, as the client's."""
        self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1
        recompute = self.config.policy is Policy.RECOMPUTE and not client_error
        self.engine.load_failed(load.request_id, error, recompute=recompute,
                                failure=Failure.KV_PARAMS if client_error else Failure.KV_LOAD)

    def _release_msg(self, load: Load, ok: bool) -> P.Release:
        kv = load.kv
        return P.Release(0, kv.engine_id, kv.lease_id, self.holder, load.attempt, ok)

    def _abort_msg(self, load: Load) -> P.Abort:
        kv = load.kv
        return P.Abort(0, kv.engine_id, kv.lease_id, self.holder, load.attempt)

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
        if (load.phase, phase) not in PHASE_TRANSITIONS:
            raise IllegalPhase(f"load {load.request_id}: {load.phase.value} -> {phase.value} "
                               "is not a legal phase change")
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
            self.loads.pop(f"rejected:{load.attempt}", None)


def _code(value: str) -> P.ErrorCode | None:
    try:
        return P.ErrorCode(value)
    except ValueError:
        return None
