"""The decode side of the connector, in vLLM's worker: kvrelay's receiver pulling
leases into vLLM's blocks, and what it reports back to vLLM's scheduler.

vLLM's scheduler allocated the blocks (``update_state_after_alloc``) and holds the
request in WAITING_FOR_REMOTE_KVS until a worker lists it in ``finished_recving``;
a failed load is listed in ``failed_recving`` too, and vLLM's
``kv_load_failure_policy`` then recomputes (or fails) it. ``VllmKvLoads`` is the
receiver's ``KvLoads`` port onto that: every load ends in exactly one report, made
only once no transfer writes into the request's blocks:

| receiver says | reported |
|---|---|
| ``load_done`` (the fence said done) | finished_recving |
| ``load_failed`` (the transfer stopped, or never started) | finished_recving + failed_recving |
| ``transfer_ended`` (an aborted request's transfer stopped) | finished_recving (vLLM frees) |
| abort before any transfer started | finished_recving (vLLM frees) |
| ``quarantine`` (a transfer past its drain bound) | nothing until ``unquarantine`` |

(A quarantined request keeps its blocks in vLLM: they are not reused while a copy may
still write. tcp: the transfer's receiving thread ends within the socket timeout once
cancelled, and only then is the request reported; NIXL: UCX gives no bound on a READ it
was told to stop, so the request stays pinned until NIXL reports the READ ended; each
is counted in the ``quarantined`` stat and logged once.)

A receiver thread applies relay replies and timers (heartbeats, retransmits, drains)
between vLLM's steps, so a long forward pass does not stall a pull. vLLM's hooks never
wait on it: ``start_load_kv`` queues, ``get_transfer_results`` and the stats take only
the report lock (``VllmKvLoads.lock``), never the receiver's, which is held across a
READ post or a dial. Every unit of work (a load, an abort, a give-back, a reply) runs
in its own ``try``: an exception fails that load alone (``failed_recving``: vLLM
recomputes), after its transfer, if one runs, has stopped.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrelay.relay import protocol as P
from kvrelay.relay.client import is_local
from kvrelay.relay.lease import part_id
from kvrelay.relay.port import Failure
from kvrelay.relay.receiver import Phase, Policy
from kvrelay.relay.remote import RemoteKv
from kvrelay.relay.sides import build_decode_side
from kvrelay.relay.transports.layout import HostCache, TensorCache
from kvrelay.relay.transports.tcp import TcpTransport
from kvrelay.sampling_params import SamplingParams
from kvrelay.vllm import faults
from kvrelay.vllm.devices import fence, kv_blocks
from kvrelay.vllm.settings import ConnectorSettings

log = logging.getLogger(__name__)


# Put on the relay client's reply queue by start(), and by the tcp transport when a
# transfer ends: wakes the receiver thread at once.
_WAKE = P.Reply(0, "wake")
# How often a running transfer is polled: tcp wakes the thread when it ends (this is
# a safety net); NIXL cannot, and a READ seen done a poll late costs that poll.
POLL_S = {"tcp": 0.01, "nixl": 0.001, "cuda_ipc": 0.001}


@dataclass(frozen=True)
class LoadSpec:
    """A load the scheduler asks for (in the step's connector metadata)."""

    request_id: str
    params: dict[str, Any]  # kv_transfer_params, validated by the scheduler already
    prompt_token_ids: list[int]
    block_ids: list[int]  # the prompt's blocks on this engine
    cached_blocks: int  # leading blocks this engine's prefix cache holds: not pulled


class VllmKvLoads:
    """``KvLoads`` over vLLM's scheduler: loads end in reports (see the module table).
    The receiver calls it under the receiver lock; the reports it queues (``finished``,
    ``failed``, the pull times) sit under its own ``lock``, which vLLM's step takes."""

    def __init__(self, ready: threading.Event | None = None,
                 timing: Callable[[str], dict[str, float]] | None = None,
                 nbytes: Callable[[str], int] | None = None) -> None:
        self.ready = ready or threading.Event()  # set when a report is queued
        self.timing = timing  # a load's phases in ms (Receiver.timing), for the log
        self.nbytes = nbytes  # the bytes a load copied, for the stats
        self.lock = threading.Lock()
        self._pending: dict[str, tuple[list[int], int]] = {}
        self._waiting: list[tuple[str, list[int], int]] = []
        self._live: set[str] = set()  # admitted, not reported yet
        self._sizes: dict[str, tuple[int, int]] = {}  # (blocks pulled, blocks), for the log
        self._started: dict[str, float] = {}  # pull started (ACQUIRE answered), for the log
        self.quarantined: dict[str, bool | None] = {}  # rid -> deferred report (failed?)
        # Under ``lock``: reports not yet taken by vLLM, and pulls committed since the
        # last stats: (load ms, its phases, when it committed), logged when vLLM takes
        # the report, with how long that took.
        self.load_ms: list[float] = []
        self.load_bytes: list[int] = []
        self._committed: dict[str, tuple[float, dict[str, float], float]] = {}
        self.finished: set[str] = set()
        self.failed: set[str] = set()

    def expect(self, request_id: str, block_ids: list[int], cached: int) -> None:
        self._pending[request_id] = (block_ids, cached)

    def admit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
              *, eos_token_ids: Sequence[int], remote_kv: Any, first_token: int) -> bool:
        blocks, cached = self._pending.pop(request_id)
        self._live.add(request_id)
        self._waiting.append((request_id, blocks, cached))
        self._sizes[request_id] = (len(blocks) - cached, len(blocks))
        return False  # vLLM's decode samples the first token itself

    def reject(self, request_id: str, error: str) -> None:
        """Refused before admission: nothing was pulled, vLLM gets the failure."""
        self._pending.pop(request_id, None)
        self._live.add(request_id)
        self.load_failed(request_id, error, recompute=True)

    def abort(self, request_id: str) -> bool:
        return request_id in self._live

    def fail_unheld(self, request_id: str, error: str) -> None:
        """A load the receiver does not hold (it raised before or while admitting it):
        nothing writes into its blocks; reported failed unless it was already."""
        if request_id in self._pending:
            self.reject(request_id, error)
        elif request_id in self._live and request_id not in self.quarantined:
            self.load_failed(request_id, error, recompute=True)

    def live(self, request_id: str) -> bool:
        return request_id in self._live

    def take_waiting(self) -> list[tuple[str, list[int], int]]:
        """Loads to start (a load that failed before it started is not among them)."""
        out, self._waiting = self._waiting, []
        return [w for w in out if w[0] in self._live]

    def load_started(self, request_id: str) -> None:
        pulled, total = self._sizes.pop(request_id, (0, 0))
        self._started[request_id] = time.monotonic()
        log.debug("kvrelay: pulling the KV of request %s (%d of %d blocks; %d in this "
                  "engine's prefix cache)", request_id, pulled, total, total - pulled)

    def load_done(self, request_id: str, *, shareable: bool) -> None:
        t0 = self._started.pop(request_id, None)
        if t0 is not None:
            now = time.monotonic()
            ms = 1000 * (now - t0)
            phases = self.timing(request_id) if self.timing is not None else {}
            nbytes = self.nbytes(request_id) if self.nbytes is not None else 0
            with self.lock:
                self.load_ms.append(ms)
                self.load_bytes.append(nbytes)
                self._committed[request_id] = (ms, phases, now)
        self.report(request_id, failed=False)

    def load_failed(self, request_id: str, error: str, *, recompute: bool,
                    failure: Failure = Failure.KV_LOAD) -> None:
        log.info("kvrelay: KV load of %s failed: %s", request_id, error)
        self.report(request_id, failed=True)

    def transfer_ended(self, request_id: str) -> None:
        self.report(request_id, failed=False)

    def quarantine(self, request_id: str) -> list[int]:
        log.warning("kvrelay: the KV transfer of request %s did not stop when told to: the "
                    "request keeps its blocks until the transport says it ended",
                    request_id)
        self.quarantined[request_id] = None
        return []  # the blocks stay the request's in vLLM until unquarantine reports

    def unquarantine(self, request_id: str, block_ids: Sequence[int]) -> None:
        failed = self.quarantined.pop(request_id)
        if failed is not None:
            self._emit(request_id, failed)

    def report(self, request_id: str, *, failed: bool) -> None:
        if request_id in self.quarantined:
            self.quarantined[request_id] = failed  # reported once the transfer stops
            return
        self._emit(request_id, failed)

    def _emit(self, request_id: str, failed: bool) -> None:
        self._live.remove(request_id)  # a second report of a load raises here
        self._sizes.pop(request_id, None)
        self._started.pop(request_id, None)
        with self.lock:
            self.finished.add(request_id)
            if failed:
                self.failed.add(request_id)
        self.ready.set()

    def take(self) -> tuple[set[str], set[str]]:
        with self.lock:
            out = self.finished, self.failed
            self.finished, self.failed = set(), set()
            committed = [(rid, self._committed.pop(rid)) for rid in out[0]
                         if rid in self._committed]
        now = time.monotonic()
        for rid, (ms, phases, at) in committed:
            log.debug("kvrelay: KV of request %s loaded in %.1f ms (copy and commit; %s; "
                      "reported to vLLM %.1f ms later)", rid, ms,
                      ", ".join(f"{k} {v:.1f}" for k, v in phases.items()),
                      1000 * (now - at))
        return out


class DecodeSide:
    """The receiver, its relay client and tcp transport, and the thread driving them."""

    def __init__(self, settings: ConnectorSettings, cache: HostCache | TensorCache,
                 compat: str, engine_id: str,
                 ready: threading.Event | None = None, *, rank: int = 0,
                 workers: int = 1, kv_dtype: str = "", part: tuple[int, int] | None = None,
                 layout: str | None = None) -> None:
        self.settings = settings
        # The rank of the prefill worker whose leases this side pulls, among P's
        # ``workers`` (``rank_entries``): this worker's own rank at the same size.
        self.rank, self.workers = rank, workers
        # (i, k): this worker holds head slice i of k of that P worker's heads, so it
        # pulls part i of k of each lease (lease.py, Parts) and HELLOs with that worker's
        # ``layout`` name (layout.widened) and compat.
        self.part = part
        self.loads = VllmKvLoads(ready, timing=lambda rid: self.receiver.timing(rid),
                                 nbytes=self._nbytes)
        self.kv_blocks = kv_blocks(cache, settings)
        # Policy recompute: a failure is reported as failed_recving, and vLLM's own
        # kv_load_failure_policy decides between recompute and an error.
        parts = build_decode_side(
            self.loads, settings.sides(), engine_id=engine_id, compat=compat,
            kv_cache=cache, kv_blocks=self.kv_blocks, layout=layout or cache.layout.name,
            kv_dtype=kv_dtype, policy=Policy.RECOMPUTE, new_attempt=lambda: secrets.token_hex(8))
        self.receiver, self.transport = parts.receiver, parts.transport
        self.client = parts.clients[0]
        if isinstance(self.transport, TcpTransport):
            self.transport.on_end = lambda _handle: self.client.replies.put(_WAKE)
            self.transport.commit = True  # the verdict after the bytes: no commit round trip
        self._poll_s = POLL_S.get(settings.kv_transport, 0.01)
        self.lock = threading.Lock()  # the receiver's: held across a READ post or a dial
        self._inbox: queue.SimpleQueue[
            tuple[Sequence[LoadSpec], Sequence[str], Sequence[dict[str, Any]]]] = (
            queue.SimpleQueue())
        self.engine_id = engine_id
        self.errors = 0  # units of work that raised (each failed alone)
        self._seen_fallbacks: dict[str, int] = {}  # receiver counts at the last stats
        self._seen_fence = 0
        self._sent_quarantined = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drive, daemon=True, name="kvrelay-recv")
        self._thread.start()

    def start(self, loads: Sequence[LoadSpec], aborts: Sequence[str],
              give_back: Sequence[dict[str, Any]] = ()) -> None:
        """From vLLM's step: the receiver thread submits them (the threads of the relay
        client and the transport are started from there, on the relay's CPUs).
        ``give_back``: params of requests that ended before any load (aborted while
        queued, refused params, or vLLM's rejection path): P is told ABORT so it frees
        at once."""
        # On vLLM's thread, before the loads are queued: a staged copy into their blocks
        # waits for the forward passes queued so far (one may still use blocks a
        # request freed a step ago, under async scheduling).
        fence([self.kv_blocks, self.transport], [b for spec in loads for b in spec.block_ids])
        self._inbox.put((loads, aborts, give_back))
        self.client.replies.put(_WAKE)

    def _take_inbox(self, now: float) -> None:
        while True:
            try:
                loads, aborts, give_back = self._inbox.get_nowait()
            except queue.Empty:
                return
            for spec in loads:
                self._guarded(spec.request_id, self._submit, spec, now)
            for rid in aborts:
                self._guarded(rid, self._abort, rid, now)
            for params in give_back:
                self._guarded("", self._give_back, params)

    def _guarded(self, rid: str, fn: Callable[..., None], *args: Any) -> None:
        """One unit of work: an exception fails request ``rid``'s load alone."""
        try:
            fn(*args)
        except Exception as e:
            self.errors += 1
            log.exception("kvrelay: %s of request %s failed", fn.__name__.strip("_"),
                          rid or "-")
            if rid:
                self._fail(rid, f"{type(e).__name__}: {e}")

    def _fail(self, rid: str, why: str) -> None:
        """Fail a load whose driver raised. A load the receiver holds ends the way its
        own failures do (a transfer that may still write is stopped first: drained or
        quarantined); one it does not hold writes nothing and is reported at once."""
        try:
            self.receiver.fail(rid, "connector_error", f"the connector failed: {why}",
                               time.monotonic())
        except Exception:
            log.exception("kvrelay: failing the load of %s failed", rid)
        if rid not in self.receiver.loads:
            self.loads.fail_unheld(rid, why)

    def _give_back(self, params: dict[str, Any]) -> None:
        """ABORT leases no load of ours holds, under a fresh attempt: P frees a HELD
        lease (or one it has not made yet, when it makes it); one another attempt pulls
        refuses it (not_holder); a released one answers released. The answer has no load
        and is counted stale. Never sent to a relay this engine would not pull from.
        With tensor parallelism every worker gets the params: worker ``r`` gives back
        P's leases ``i`` with ``i % workers == r``, so each is given back once."""
        try:
            entries = rank_entries(params)
        except ValueError:
            entries = [params]
        for i, entry in enumerate(entries):
            if i % self.workers != self.rank:
                continue
            try:
                kv = RemoteKv.from_client(self._ours(entry))  # host:port, or nothing
            except ValueError:
                continue
            if self.trusts(kv.relay):
                self.client.send(kv.relay, P.Abort(0, kv.engine_id, kv.lease_id,
                                                   self.engine_id, secrets.token_hex(8)))

    def _ours(self, entry: dict[str, Any]) -> dict[str, Any]:
        """A P worker's lease params as this side pulls them: its part, if it has one."""
        lid = entry.get("lease_id")
        if self.part is None or not isinstance(lid, str):
            return entry
        return {**entry, "lease_id": part_id(lid, *self.part)}

    def _nbytes(self, rid: str) -> int:
        load = self.receiver.loads.get(rid)
        status = load.transfer if load is not None else None
        return status.nbytes if status is not None else 0

    def trusts(self, relay: str) -> bool:
        return trusts(self.settings, relay)

    def _submit(self, spec: LoadSpec, now: float) -> None:
        self.loads.expect(spec.request_id, spec.block_ids, spec.cached_blocks)
        try:
            faults.hit("submit", spec.request_id)
            # this worker's rank's lease (the scheduler checked there is one per rank)
            kv = RemoteKv.from_client(self._ours(rank_entries(spec.params)[self.rank]))
            if not self.trusts(kv.relay):
                raise ValueError(UNTRUSTED.format(relay=kv.relay))
            self.receiver.submit(spec.request_id, spec.prompt_token_ids, SamplingParams(), kv,
                                 now)
        except ValueError as e:  # RequestRejected too
            # Rejected before any transfer (P was told ABORT): vLLM recomputes or fails.
            self.loads.reject(spec.request_id, str(e))
        except Exception:
            if spec.request_id not in self.receiver.loads:
                self._give_back(spec.params)  # P was told nothing: ABORT frees it now
            raise

    def _abort(self, rid: str, now: float) -> None:
        load = self.receiver.loads.get(rid)
        if load is None or not self.loads.live(rid):
            return  # already reported: vLLM frees it on that report
        no_transfer = load.phase in (Phase.ADMITTING, Phase.ACQUIRING)
        self.receiver.abort(rid, now)
        if no_transfer:
            self.loads.transfer_ended(rid)  # nothing writes: vLLM may free now

    def take_finished(self) -> tuple[set[str], set[str]]:
        return self.loads.take()

    def collect_stats(self, data: dict[str, Any]) -> None:
        """Add what happened since the last call to ``data`` (connector.KvRelayStats).
        Reads the receiver's counters without its lock (whole-value reads)."""
        with self.loads.lock:
            data["load_ms"].extend(self.loads.load_ms)
            data.setdefault("load_bytes", []).extend(self.loads.load_bytes)
            self.loads.load_ms, self.loads.load_bytes = [], []
        st = self.receiver.stats
        fallbacks = dict(st.fallbacks)
        for why, n in fallbacks.items():
            new = n - self._seen_fallbacks.get(why, 0)
            if new:
                data["fallbacks"][why] = data["fallbacks"].get(why, 0) + new
        self._seen_fallbacks = fallbacks
        fence = st.fence_failures
        data["fence_refused"] += fence - self._seen_fence
        self._seen_fence = fence
        quarantined = len(self.loads.quarantined)
        if quarantined != self._sent_quarantined:  # a gauge: sent when it changes
            data["quarantined"] = self._sent_quarantined = quarantined

    def _drive(self) -> None:
        replies = self.client.replies
        while not self._stop.is_set():
            try:
                with self.lock:
                    wake = self.receiver.next_wakeup()
                    # Running transfers are polled; otherwise only replies, start()
                    # and timers wake us.
                    wait = self._poll_s if self.receiver.polling() else 0.5
                if wake is not None:
                    wait = min(wait, max(0.0, wake - time.monotonic()))
                try:
                    reply: P.Reply | None = replies.get(timeout=wait)
                except queue.Empty:
                    reply = None
                with self.lock:
                    self._take_inbox(time.monotonic())
                    while reply is not None:
                        if reply is not _WAKE:
                            self._guarded(self.receiver.owner(reply.seq), self._on_reply,
                                          reply)
                        try:
                            reply = replies.get_nowait()
                        except queue.Empty:
                            reply = None
                    try:
                        self.receiver.tick(time.monotonic())
                    except Exception:
                        self._after_tick_error()
                        raise
            except Exception:  # a bug outside any one load's work: later loads go on
                self.errors += 1
                log.exception("kvrelay: receiver step failed")
                self._stop.wait(0.05)

    def _after_tick_error(self) -> None:
        """A tick raised part way: loads it took to start but never started (admitted,
        no longer waiting, no ACQUIRE sent, no timer) would wait forever. Fail them."""
        waiting = {w[0] for w in self.loads._waiting}
        for rid, load in list(self.receiver.loads.items()):
            if load.phase is Phase.ADMITTING and rid not in waiting:
                self._fail(rid, "the receiver's tick failed before this load started")

    def _on_reply(self, reply: P.Reply) -> None:
        rid = self.receiver.owner(reply.seq)
        if rid:
            faults.hit("reply", rid)
        self.receiver.on_reply(reply, time.monotonic())

    def close(self) -> None:
        self._stop.set()
        self.client.close()
        self.transport.close()
        self._thread.join(timeout=5)


class MappedDecode:
    """A decode worker pulling from a prefill engine of another tensor-parallel size.

    P with ``k`` times its workers: worker ``r``'s heads are P's ranks ``r*k .. r*k+k-1``
    heads, side by side. Each of those P ranks serves its own lease (P is unchanged), so
    worker ``r`` runs ``k`` decode sides, side ``i`` over the head slice P's rank
    ``r*k+i`` fills (layout.head_part) with that rank's compat, and pulls that rank's
    lease (``DecodeSide`` with ``rank`` = P's rank among P's ``workers``: its own entry
    of ``ranks``, and its own lease to give back). A load is reported to vLLM once all
    ``k`` pulls of it ended, failed when any did: each side reports each load once, so
    the count reaches ``k`` once.

    P with ``1/k`` of its workers: worker ``r``'s heads are slice ``r % k`` of ``k`` of P's
    rank ``r // k``'s; one side over the whole cache pulls part ``r % k`` of that rank's
    lease (``DecodeSide.part``: the lease is split on P, each part a lease of its own)."""

    def __init__(self, sides: list[DecodeSide]) -> None:
        self.sides = sides
        self._parts: dict[str, tuple[int, bool]] = {}  # rid -> (pulls ended, any failed)

    def start(self, loads: Sequence[LoadSpec], aborts: Sequence[str],
              give_back: Sequence[dict[str, Any]] = ()) -> None:
        for side in self.sides:
            side.start(loads, aborts, give_back)

    def take_finished(self) -> tuple[set[str], set[str]]:
        done: set[str] = set()
        failed: set[str] = set()
        for side in self.sides:
            finished, bad = side.take_finished()
            for rid in finished:
                n, any_bad = self._parts.pop(rid, (0, False))
                n, any_bad = n + 1, any_bad or rid in bad
                if n < len(self.sides):
                    self._parts[rid] = (n, any_bad)
                    continue
                done.add(rid)
                if any_bad:
                    failed.add(rid)
        return done, failed

    def collect_stats(self, data: dict[str, Any]) -> None:
        for side in self.sides:
            side.collect_stats(data)

    def close(self) -> None:
        for side in self.sides:
            side.close()


def p_ranks_refused(p_workers: int, workers: int, heads: int, transport: str = "tcp"
                    ) -> str:
    """Why this decode engine (``workers`` tensor-parallel workers of ``heads`` KV heads
    each) cannot pull from a prefill engine of ``p_workers`` workers ('' where it can:
    the same size; ``k`` times it with the heads splitting evenly; ``1/k`` of it with
    more than one head a worker, over tcp)."""
    if p_workers == workers:
        return ""
    why = (f"ranks: the prefill engine serves the KV from {p_workers} tensor-parallel "
           f"workers, this engine has {workers} workers of {heads} KV heads each: ")
    if p_workers > workers and (p_workers % workers or heads * workers % p_workers):
        return why + ("a larger prefill engine must have a multiple of this engine's "
                      "workers, splitting its heads evenly")
    if p_workers < workers:
        if workers % p_workers:
            return why + "a smaller prefill engine must have a divisor of its workers"
        if heads < 2:
            return why + ("with one head a worker, where a prefill worker's heads lie in "
                          "its blocks is not known here (not supported yet)")
        if transport != "tcp":
            return why + (f"a smaller prefill engine's leases are read in parts over tcp "
                          f"only, this engine's kv_transport is {transport}")
    return ""


def mapped_size(params: dict[str, Any], workers: int, heads: int, transport: str
                ) -> int | None:
    """The prefill engine's worker count these params name, where this decode engine
    pulls them through sides of its own for that size (``MappedDecode``); None where its
    own side takes them: the same size, or a size the scheduler refuses (refused params
    are given back: worker r aborts P's leases i with i mod T = r, whole)."""
    try:
        p_workers = len(rank_entries(params))
    except ValueError:
        return None
    if p_workers == workers or p_ranks_refused(p_workers, workers, heads, transport):
        return None
    return p_workers


MAX_RANKS = 64  # tensor-parallel workers a prefill engine's params may name
RANK_FIELDS = frozenset({"lease_id", "relay", "engine_id", "compat"})


def rank_entries(params: dict[str, Any]) -> list[dict[str, Any]]:
    """The params of each of P's tensor-parallel workers' leases, by rank: ``ranks``
    (one lease, relay, engine id and compat per worker; the other fields shared) or,
    without it, the params themselves (one worker). Raises ValueError naming what is
    wrong (a client writes these)."""
    ranks = params.get("ranks")
    if ranks is None:
        return [params]
    if (not isinstance(ranks, list) or not 1 <= len(ranks) <= MAX_RANKS
            or not all(isinstance(r, dict) for r in ranks)):
        raise ValueError(f"ranks must be a list of 1 to {MAX_RANKS} objects, one per "
                         f"tensor-parallel worker of the prefill engine")
    shared = {k: v for k, v in params.items() if k != "ranks"}
    out = []
    for r in ranks:
        if set(r) != RANK_FIELDS:
            raise ValueError(f"ranks: each entry has exactly the fields "
                             f"{sorted(RANK_FIELDS)}, got {sorted(map(str, r))[:8]}")
        out.append({**shared, **r})
    return out


UNTRUSTED = (
    "the relay {relay} is not on this host and no relay_secret proves it: its KV would "
    "enter this engine's prefix cache, which vLLM shares between requests; set "
    "relay_secret on both engines (or trust_unauthenticated_relays: true)")


def trusts(settings: ConnectorSettings, relay: str) -> bool:
    """May this engine pull from ``relay``? vLLM caches every committed load for other
    requests, so only KV it may share: from a relay that proved the secret (with one,
    every relay must), one on this host, or any with the operator's opt-in."""
    return (settings.secret is not None or settings.trust_unauthenticated_relays
            or is_local(relay))
