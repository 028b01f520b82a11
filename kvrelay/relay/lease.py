"""The prefill side's lease table: KV blocks held for a decode engine, released once.

When a prefill-role request finishes with reason ``remote_decode`` (after its
in-flight fence), its blocks move from the request to a lease in one step of the
port (``LeaseBlocks.hold``). The lease then lives through one table of transitions:

    HELD    --ACQUIRE(attempt)-----> PULLING   (acquire deadline restarts)
    PULLING --ACQUIRE(same attempt)> PULLING   (a duplicate: answered, no change)
    PULLING --HEARTBEAT(attempt)---> PULLING   (deadline extended, never past the cap)
    HELD|PULLING --RELEASE(ok)-----> RELEASED(done)
    HELD|PULLING --RELEASE(failed)-> RELEASED(failed)
    HELD|PULLING --ABORT-----------> RELEASED(aborted)
    HELD|PULLING --deadline--------> RELEASED(expired)

A lease is a capability of one request attempt (holder = the decode engine's id,
attempt = a fresh nonce per request on it). The first ACQUIRE binds it; every other
attempt, from the same engine or another, is refused (``lease_busy``), and only the
binding attempt may read, heartbeat, release or abort it. Once RELEASED, the
record (a tombstone) remembers which attempt held it: a retransmitted RELEASE(ok)
from the attempt that committed is answered ``ok``/``done`` again, and every other
message is answered ``released`` with the reason, under which nothing commits.

A partial pull: a decode engine that already holds the prompt's first blocks in its
own prefix cache names the first block it pulls in its ACQUIRE (``first_block``). The
lease then covers the range from there on: the blocks before it are released at that
ACQUIRE (they are never read) and the fence covers exactly the blocks pulled.

Entering RELEASED frees the lease's blocks; that, and the release of the blocks a
partial pull skips, are the only places this module frees anything. Every later
message about the lease is counted in ``stale_messages``, nothing more.

The fence (DESIGN section 3): while a lease is HELD or PULLING the pool says the
lease owns its blocks, so nobody can free or reuse them. A decode engine that
copied the blocks commits by RELEASE(ok): the table answers ``done`` only if the
lease is still live, bound to that attempt, and the pool's current generation of
every block equals the one recorded when the lease was made, so the copy happened
while the blocks could not change. Any other answer tells the reader its copy may
be torn.

Parts (``splittable`` tables: vLLM's prefill workers, for decode engines with more
tensor-parallel workers than P, docs/vllm.md): a HELD lease ``X`` can be cut into ``k``
parts, leases ``X/0/k`` .. ``X/k-1/k`` over the same blocks, each a lease like any
other (its own attempt, deadline and one release) that serves head slice ``i`` of ``k``
(``Lease.part``). The first ACQUIRE or ABORT naming a part of a HELD ``X`` makes all
``k`` and releases ``X`` (reason ``split``) in one step: the parts hold the blocks
before ``X`` lets go of them, so they are never free in between, and ``X``'s generations
are theirs (the fence still covers the copy since ``X`` was made). A part of a lease
being pulled whole is refused (``lease_busy``), and ``X`` itself is released once split.
ABORTs of parts of a lease not made yet are remembered as ABORTs are: when ``X`` is made
it is split and those parts released at once. The proxy's ABORT of a split ``X`` (no
holder) releases its live parts, as it would have released ``X``.

    HELD --ACQUIRE or ABORT of a part of k--> RELEASED(split), k parts HELD

Pure: the clock comes in as ``now`` arguments, lease ids from ``new_lease_id``.
Deadlines sit in a heap with lazy deletion (an entry whose deadline no longer
matches its lease is skipped), so arming, renewing and expiring cost O(log n).
"""

from __future__ import annotations

import enum
import heapq
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvrelay.relay.port import LeaseBlocks
from kvrelay.relay.protocol import ErrorCode

MAX_EARLY_ABORTS = 4096  # ABORTs of pending leases remembered (the oldest are dropped)
MAX_PARTS = 64  # parts a lease may be split into (a decode engine's workers per P rank)


class LeaseState(enum.Enum):
    HELD = "held"
    PULLING = "pulling"
    RELEASED = "released"


class ReleaseReason(enum.Enum):
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"
    EXPIRED = "expired"
    SPLIT = "split"  # cut into parts (leases of their own) for another engine's workers


class LeaseEvent(enum.Enum):
    ACQUIRE = "acquire"
    HEARTBEAT = "heartbeat"
    RELEASE_OK = "release_ok"
    RELEASE_FAILED = "release_failed"
    ABORT = "abort"
    EXPIRE = "expire"
    SPLIT = "split"


class Status(enum.Enum):
    OK = "ok"
    # The lease was released before this message; ``reason`` says why.
    RELEASED = "released"
    # The message cannot apply: unknown lease, wrong engine, other holder, ...
    ERROR = "error"


L, LE, R = LeaseState, LeaseEvent, ReleaseReason

# (state, event) -> (next state, release reason when it releases)
LEASE_TRANSITIONS: dict[tuple[LeaseState, LeaseEvent], tuple[LeaseState, ReleaseReason | None]] = {
    (L.HELD, LE.ACQUIRE): (L.PULLING, None),
    (L.PULLING, LE.HEARTBEAT): (L.PULLING, None),
    (L.HELD, LE.RELEASE_OK): (L.RELEASED, R.DONE),
    (L.PULLING, LE.RELEASE_OK): (L.RELEASED, R.DONE),
    (L.HELD, LE.RELEASE_FAILED): (L.RELEASED, R.FAILED),
    (L.PULLING, LE.RELEASE_FAILED): (L.RELEASED, R.FAILED),
    (L.HELD, LE.ABORT): (L.RELEASED, R.ABORTED),
    (L.PULLING, LE.ABORT): (L.RELEASED, R.ABORTED),
    (L.HELD, LE.EXPIRE): (L.RELEASED, R.EXPIRED),
    (L.PULLING, LE.EXPIRE): (L.RELEASED, R.EXPIRED),
    (L.HELD, LE.SPLIT): (L.RELEASED, R.SPLIT),
}

del L, LE, R


def part_id(lease_id: str, i: int, k: int) -> str:
    """The id of part ``i`` of ``k`` of lease ``lease_id``."""
    return f"{lease_id}/{i}/{k}"


def parse_part(lease_id: str) -> tuple[str, int, int] | None:
    """(lease, i, k) of a part's id; None for any other id."""
    parent, sep, tail = lease_id.partition("/")
    i, sep2, k = tail.partition("/")
    if not (sep and sep2 and i.isascii() and i.isdigit() and k.isascii() and k.isdigit()
            and len(i) <= 2 and len(k) <= 2):
        return None
    n, of = int(i), int(k)
    return (parent, n, of) if 2 <= of <= MAX_PARTS and n < of else None


def new_random_lease_id() -> str:
    """128 random bits: a lease id is a capability, so it must be unguessable."""
    return secrets.token_hex(16)


@dataclass(eq=False)
class Lease:
    lease_id: str
    request_id: str
    block_ids: list[int]
    generations: list[int]
    num_tokens: int
    first_token: int
    created: float
    deadline: float  # acquire deadline; renewed by heartbeats while PULLING
    hard_deadline: float
    state: LeaseState = LeaseState.HELD
    reason: ReleaseReason | None = None
    holder: str | None = None
    attempt: str | None = None
    unread: set[int] = field(default_factory=set)  # blocks the attempt may still READ
    # A partial pull: how many leading blocks the holder had cached (released at its
    # ACQUIRE; ``block_ids`` and ``generations`` then hold the rest, the pulled range).
    first_block: int = 0
    prompt_digest: bytes = b""  # protocol.prompt_digest of the request's prompt
    part: tuple[int, int] | None = None  # (i, k): head slice i of k (a split lease's part)

    def held_by(self, holder: str, attempt: str) -> bool:
        return self.holder == holder and self.attempt == attempt


@dataclass(slots=True)
class Tombstone:
    """What is remembered of a released lease, to answer late messages."""

    released_at: float
    reason: ReleaseReason
    holder: str | None
    attempt: str | None
    fence_counted: bool = False  # this lease's one fence failure has been counted


@dataclass(frozen=True)
class Answer:
    """The table's answer to one message: what the relay server replies."""

    status: Status
    state: LeaseState | None = None
    reason: ReleaseReason | None = None
    error: str = ""
    lease: Lease | None = None
    code: ErrorCode = ErrorCode.NONE

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


@dataclass
class LeaseStats:
    created: int = 0
    released: dict[str, int] = field(default_factory=dict)  # by ReleaseReason value
    stale_messages: int = 0  # messages about released, unknown or foreign leases
    # RELEASE(ok) of the attempt that held the lease, refused because the lease was
    # released under it or its blocks changed: a copy that may be torn. Counted once
    # per lease; retransmissions and other attempts' messages are not counted.
    fence_failures: int = 0
    # Leading blocks of leases that decode engines had in their own prefix cache:
    # released at ACQUIRE, never sent (partial pulls).
    skipped_blocks: int = 0
    active: dict[str, int] = field(default_factory=lambda: {"held": 0, "pulling": 0})


class LeaseTable:
    def __init__(
        self,
        blocks: LeaseBlocks,
        *,
        engine_id: str,
        acquire_timeout: float = 30.0,
        hard_cap: float = 480.0,
        tombstone_ttl: float | None = None,
        new_lease_id: Callable[[], str] = new_random_lease_id,
        pending: Callable[[str], bool] | None = None,
        splittable: Callable[[int], bool] | None = None,
    ) -> None:
        if not 0 < acquire_timeout <= hard_cap:
            raise ValueError(
                f"need 0 < acquire_timeout ({acquire_timeout}) <= hard_cap ({hard_cap})"
            )
        self.blocks = blocks
        self.engine_id = engine_id
        self.acquire_timeout = acquire_timeout
        self.hard_cap = hard_cap
        self.tombstone_ttl = hard_cap if tombstone_ttl is None else tombstone_ttl
        self._new_id = new_lease_id
        # May a HELD lease be cut into k parts (the port's blocks may be held by several
        # leases at once, and the cache's heads split in k: vLLM's prefill workers)?
        # None: never, a part's id is unknown.
        self.splittable = splittable
        # ABORTs of parts of pending leases (in ``_aborted_early``), by lease
        self._early_parts: dict[str, list[str]] = {}
        self._parts: dict[str, int] = {}  # how many parts a split lease has, while remembered
        # A lease id the engine has handed out but not made yet (vLLM: the scheduler
        # names it, the worker makes it a step later): answered NOT_YET, not unknown.
        self.pending = pending
        # ABORTs of pending leases, oldest first (bounded): the lease is released the
        # moment it is made, so a decode engine that gave up on it frees P at once.
        self._aborted_early: OrderedDict[str, float] = OrderedDict()
        self.leases: dict[str, Lease] = {}  # HELD or PULLING
        # Released leases, oldest first, kept a while to answer late messages.
        self._tombstones: OrderedDict[str, Tombstone] = OrderedDict()
        self._deadlines: list[tuple[float, str]] = []
        self.stats = LeaseStats()

    # -- creation ----------------------------------------------------------------
    def create(
        self,
        request_id: str,
        block_ids: Sequence[int],
        now: float,
        *,
        num_tokens: int,
        first_token: int,
        prompt_digest: bytes = b"",
        lease_id: str | None = None,
    ) -> Lease:
        """Take a finished request's blocks: one hand-over, then the timer is armed.

        Both happen in this one call, so no message can find the lease without a
        deadline (race 1: a RELEASE racing the arming of the timer). ``lease_id``: the
        id the engine handed out already (``pending``); otherwise a fresh one. A lease
        a decode engine aborted while it was pending is released at once (aborted).
        """
        lease_id = self._new_id() if lease_id is None else lease_id
        if lease_id in self.leases or lease_id in self._tombstones:
            raise RuntimeError(f"lease id {lease_id} generated twice")
        ids = list(block_ids)
        self.blocks.hold(request_id, ids, lease_id)
        lease = Lease(
            lease_id=lease_id,
            request_id=request_id,
            block_ids=ids,
            generations=self.blocks.generations(ids),
            num_tokens=num_tokens,
            first_token=first_token,
            prompt_digest=prompt_digest,
            created=now,
            deadline=now + self.acquire_timeout,
            hard_deadline=now + self.hard_cap,
        )
        self.leases[lease_id] = lease
        self.stats.created += 1
        self.stats.active["held"] += 1
        heapq.heappush(self._deadlines, (lease.deadline, lease_id))
        if self._aborted_early.pop(lease_id, None) is not None:
            self._release(lease, LeaseEvent.ABORT, now)
        elif lease_id in self._early_parts:
            # a decode worker gave its part up before this lease was made
            pids = self._early_parts.pop(lease_id)
            parsed = parse_part(pids[0])
            assert parsed is not None
            self._split(lease, parsed[2], now)
            for pid in pids:
                self._aborted_early.pop(pid, None)
                part = self.leases.get(pid)
                if part is not None:
                    self._release(part, LeaseEvent.ABORT, now)
        return lease

    # -- messages from decode engines ----------------------------------------------
    def acquire(
        self, engine_id: str, lease_id: str, holder: str, attempt: str, now: float,
        first_block: int = 0,
    ) -> Answer:
        """Bind the lease to this attempt. ``first_block`` > 0: the decode engine has the
        blocks before it cached; they are released now and the lease covers the rest
        (none, when it has them all: it still acquires, to check its params against
        the lease, and commits an empty copy). A part's id splits its HELD lease first."""
        lease, answer = self._find(engine_id, lease_id, holder, attempt, split_at=now)
        if lease is None:
            return answer
        if lease.state is LeaseState.PULLING:
            if lease.held_by(holder, attempt):  # a duplicated or retried ACQUIRE
                return Answer(Status.OK, lease.state, lease=lease)
            return self._stale(f"lease {lease_id} is being pulled by another request",
                               ErrorCode.LEASE_BUSY)
        if not 0 <= first_block <= len(lease.block_ids):
            return self._stale(
                f"first_block {first_block} is outside lease {lease_id}'s "
                f"{len(lease.block_ids)} blocks", ErrorCode.BAD_RANGE)
        self._apply(lease, LeaseEvent.ACQUIRE, now)
        lease.holder, lease.attempt = holder, attempt
        if first_block:
            self.blocks.release(lease_id, lease.block_ids[:first_block])
            del lease.block_ids[:first_block]
            del lease.generations[:first_block]
            lease.first_block = first_block
            self.stats.skipped_blocks += first_block
        lease.unread = set(lease.block_ids)
        self._rearm(lease, now)
        return Answer(Status.OK, lease.state, lease=lease)

    def heartbeat(
        self, engine_id: str, lease_id: str, holder: str, attempt: str, now: float
    ) -> Answer:
        lease, answer = self._find(engine_id, lease_id, holder, attempt)
        if lease is None:
            return answer
        if lease.state is not LeaseState.PULLING or not lease.held_by(holder, attempt):
            return self._stale(f"lease {lease_id} is not being pulled by this request",
                               ErrorCode.NOT_HOLDER)
        self._apply(lease, LeaseEvent.HEARTBEAT, now)
        self._rearm(lease, now)
        return Answer(Status.OK, lease.state, lease=lease)

    def release(
        self, engine_id: str, lease_id: str, holder: str, attempt: str, ok: bool, now: float
    ) -> Answer:
        """RELEASE(ok) is the commit of a copy; its answer is the fence's verdict."""
        lease, answer = self._find(engine_id, lease_id, holder, attempt, commit=ok)
        if lease is None:
            return answer
        if lease.state is LeaseState.PULLING and not lease.held_by(holder, attempt):
            return self._stale(f"lease {lease_id} is being pulled by another request",
                               ErrorCode.NOT_HOLDER)
        lease.holder, lease.attempt = holder, attempt  # HELD: the releasing attempt
        if ok and self.blocks.generations(lease.block_ids) != lease.generations:
            # Cannot happen while the lease owns the blocks; refuse loudly if it does.
            self.stats.fence_failures += 1
            self._release(lease, LeaseEvent.RELEASE_FAILED, now)
            self._tombstones[lease_id].fence_counted = True
            return Answer(Status.ERROR, LeaseState.RELEASED, ReleaseReason.FAILED,
                          "block generations changed during the copy", code=ErrorCode.FENCE)
        event = LeaseEvent.RELEASE_OK if ok else LeaseEvent.RELEASE_FAILED
        self._release(lease, event, now)
        return Answer(Status.OK, lease.state, lease.reason, lease=lease)

    def abort(
        self,
        engine_id: str,
        lease_id: str,
        now: float,
        holder: str | None = None,
        attempt: str | None = None,
    ) -> Answer:
        """ABORT from a decode attempt (``holder``/``attempt``: refused while another
        attempt pulls), or from the proxy (None: valid in any live state; a pulling
        attempt's commit then fails)."""
        lease, answer = self._find(engine_id, lease_id, holder or "", attempt or "",
                                   split_at=now)
        if lease is None:
            if answer.code is ErrorCode.NOT_YET:
                self._aborted_early[lease_id] = now
                self._aborted_early.move_to_end(lease_id)
                cut = parse_part(lease_id) if self.splittable is not None else None
                if cut is not None:
                    same = self._early_parts.setdefault(cut[0], [])
                    if lease_id not in same:
                        same.append(lease_id)
                while len(self._aborted_early) > MAX_EARLY_ABORTS:
                    self._forget_early(self._aborted_early.popitem(last=False)[0])
            elif holder is None and answer.reason is ReleaseReason.SPLIT:
                # the proxy gives up a lease that was split: its live parts go too, as
                # the lease itself would (a part's pull then fails its commit)
                k = self._parts.get(lease_id, 0)
                for i in range(k):
                    live = self.leases.get(part_id(lease_id, i, k))
                    if live is not None:
                        self._release(live, LeaseEvent.ABORT, now)
            return answer
        if (holder is not None and lease.state is LeaseState.PULLING
                and not lease.held_by(holder, attempt or "")):
            return self._stale(f"lease {lease_id} is being pulled by another request",
                               ErrorCode.NOT_HOLDER)
        self._release(lease, LeaseEvent.ABORT, now)
        return Answer(Status.OK, lease.state, lease.reason, lease=lease)

    def read_grant(
        self, engine_id: str, lease_id: str, holder: str, attempt: str,
        block_ids: Sequence[int],
    ) -> Answer:
        """May this attempt READ ``block_ids`` now (the tcp transport)? Each block of a
        lease is served at most once: the attempt's byte budget is the lease's size."""
        lease, answer = self._find(engine_id, lease_id, holder, attempt)
        if lease is None:
            return answer
        if lease.state is not LeaseState.PULLING or not lease.held_by(holder, attempt):
            return self._stale(f"lease {lease_id} is not acquired by this request",
                               ErrorCode.NOT_HOLDER)
        want = set(block_ids)
        if len(want) != len(block_ids) or not want <= lease.unread:
            return self._stale(f"read of lease {lease_id} names blocks outside the lease or "
                               "already read", ErrorCode.READ_DENIED)
        lease.unread -= want
        return Answer(Status.OK, lease.state, lease=lease)

    # -- time ----------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        self._drop_outdated_deadlines()
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self, now: float) -> list[Lease]:
        """Release every lease whose deadline is <= now. O(log n) per lease."""
        expired: list[Lease] = []
        heap = self._deadlines
        while True:
            self._drop_outdated_deadlines()
            if not heap or heap[0][0] > now:
                break
            _, lease_id = heapq.heappop(heap)
            lease = self.leases[lease_id]
            self._release(lease, LeaseEvent.EXPIRE, now)
            expired.append(lease)
        self._prune_tombstones(now)
        early = self._aborted_early
        while early and next(iter(early.values())) <= now - self.acquire_timeout:
            # never made within a lease timeout: forget it
            self._forget_early(early.popitem(last=False)[0])
        return expired

    def release_all(self, now: float) -> None:
        """Shutdown: every live lease is released as aborted."""
        for lease in list(self.leases.values()):
            self._release(lease, LeaseEvent.ABORT, now)

    # -- invariants ----------------------------------------------------------------
    def check_integrity(self) -> None:
        """Each live lease owns exactly its blocks. O(blocks of live leases)."""
        held = pulling = 0
        for lease in self.leases.values():
            if lease.state is LeaseState.RELEASED:
                raise AssertionError(f"released lease {lease.lease_id} is still live")
            held += lease.state is LeaseState.HELD
            pulling += lease.state is LeaseState.PULLING
            if not self.blocks.held(lease.lease_id, lease.block_ids):
                raise AssertionError(f"lease {lease.lease_id} does not own its blocks")
            if lease.deadline > lease.hard_deadline:
                raise AssertionError(f"lease {lease.lease_id} deadline beyond its hard cap")
        if self.stats.active != {"held": held, "pulling": pulling}:
            raise AssertionError(f"state gauges {self.stats.active} != {held=} {pulling=}")

    def release_reason(self, lease_id: str) -> ReleaseReason | None:
        """Why a released lease ended (None: live, unknown, or forgotten already)."""
        tomb = self._tombstones.get(lease_id)
        return tomb.reason if tomb is not None else None

    def leases_by_state(self) -> dict[str, int]:
        return dict(self.stats.active)

    @property
    def num_tombstones(self) -> int:
        """Released leases still remembered (for ``tombstone_ttl``)."""
        return len(self._tombstones)

    # -- internals -----------------------------------------------------------------
    def _find(
        self, engine_id: str, lease_id: str, holder: str, attempt: str, *, commit: bool = False,
        split_at: float | None = None,
    ) -> tuple[Lease | None, Answer]:
        """The live lease, or the answer for a message about no live lease.
        ``split_at``: a part's id of a HELD lease splits it then (ACQUIRE, ABORT)."""
        if engine_id != self.engine_id:
            return None, self._stale(
                f"lease {lease_id} belongs to engine {engine_id}, this is engine "
                f"{self.engine_id} (the prefill engine restarted)", ErrorCode.WRONG_ENGINE,
            )
        lease = self.leases.get(lease_id)
        if lease is not None:
            return lease, Answer(Status.OK)
        tomb = self._tombstones.get(lease_id)
        part = (parse_part(lease_id) if self.splittable is not None and tomb is None
                else None)
        if part is not None:
            found = self._part_of(part, lease_id, split_at)
            if found is not None:
                return found
        if tomb is None and self.pending is not None and self.pending(lease_id):
            return None, Answer(Status.ERROR, error=f"lease {lease_id} is not made yet",
                                code=ErrorCode.NOT_YET)
        self.stats.stale_messages += 1
        if tomb is None:
            return None, Answer(Status.ERROR, error=f"unknown lease {lease_id}",
                                code=ErrorCode.UNKNOWN_LEASE)
        ours = tomb.holder == holder and tomb.attempt == attempt
        if ours and commit and tomb.reason is ReleaseReason.DONE:
            # A retransmitted commit of the attempt that committed: the same verdict.
            return None, Answer(Status.OK, LeaseState.RELEASED, ReleaseReason.DONE)
        if ours and commit and not tomb.fence_counted:
            # The lease was released under this attempt's copy (expiry, abort).
            self.stats.fence_failures += 1
            tomb.fence_counted = True
        return None, Answer(Status.RELEASED, LeaseState.RELEASED, tomb.reason,
                            f"lease {lease_id} was already released ({tomb.reason.value})")

    def _stale(self, error: str, code: ErrorCode) -> Answer:
        self.stats.stale_messages += 1
        return Answer(Status.ERROR, error=error, code=code)

    def _apply(self, lease: Lease, event: LeaseEvent, now: float) -> None:
        try:
            state, reason = LEASE_TRANSITIONS[(lease.state, event)]
        except KeyError:
            raise RuntimeError(
                f"lease {lease.lease_id}: event {event.value!r} is not allowed in state "
                f"{lease.state.value!r}"
            ) from None
        if state is not lease.state:
            self.stats.active[lease.state.value] -= 1
            if state is not LeaseState.RELEASED:
                self.stats.active[state.value] += 1
        lease.state, lease.reason = state, reason

    def _release(self, lease: Lease, event: LeaseEvent, now: float) -> None:
        self._apply(lease, event, now)
        assert lease.reason is not None
        # The one release: the state change and the free sit together.
        self.blocks.release(lease.lease_id, lease.block_ids)
        del self.leases[lease.lease_id]
        self._tombstones[lease.lease_id] = Tombstone(now, lease.reason, lease.holder,
                                                     lease.attempt)
        reason = lease.reason.value
        self.stats.released[reason] = self.stats.released.get(reason, 0) + 1

    def _part_of(self, part: tuple[str, int, int], lease_id: str, split_at: float | None
                 ) -> tuple[Lease | None, Answer] | None:
        """``_find`` for an unknown part's id (``part`` parsed): the part, made now by
        splitting its HELD lease (``split_at``); a refusal while the lease is pulled
        whole; the lease's own answer once it was released whole; else None."""
        whole = self.leases.get(part[0])
        if whole is not None:
            assert self.splittable is not None
            if not self.splittable(part[2]):
                return None, self._stale(
                    f"lease {part[0]} cannot be cut into {part[2]} parts: this worker's KV "
                    f"heads do not split so", ErrorCode.BAD_RANGE)
            if whole.state is not LeaseState.HELD:
                return None, self._stale(f"lease {part[0]} is being pulled whole: its parts "
                                         "cannot be", ErrorCode.LEASE_BUSY)
            if split_at is not None:
                self._split(whole, part[2], split_at)
                return self.leases[lease_id], Answer(Status.OK)
            return None
        gone = self._tombstones.get(part[0])
        if gone is None or gone.reason is ReleaseReason.SPLIT:
            return None
        # a part of a lease released whole (expired, aborted, pulled): as the lease
        self.stats.stale_messages += 1
        return None, Answer(Status.RELEASED, LeaseState.RELEASED, gone.reason,
                            f"lease {part[0]} was already released ({gone.reason.value})")

    def _forget_early(self, lease_id: str) -> None:
        """An early ABORT dropped from ``_aborted_early``: from its lease's parts too."""
        part = parse_part(lease_id)
        same = self._early_parts.get(part[0]) if part is not None else None
        if part is not None and same is not None:
            if lease_id in same:
                same.remove(lease_id)
            if not same:
                del self._early_parts[part[0]]

    def _split(self, lease: Lease, k: int, now: float) -> None:
        """Cut HELD ``lease`` into ``k`` parts over its blocks (the module docstring): the
        parts hold the blocks before the lease is released, so they never go free."""
        ids = list(lease.block_ids)
        for i in range(k):
            pid = part_id(lease.lease_id, i, k)
            self.blocks.hold(lease.request_id, ids, pid)
            part = Lease(
                lease_id=pid, request_id=lease.request_id, block_ids=list(ids),
                generations=list(lease.generations), num_tokens=lease.num_tokens,
                first_token=lease.first_token, prompt_digest=lease.prompt_digest,
                created=now, deadline=min(now + self.acquire_timeout, lease.hard_deadline),
                hard_deadline=lease.hard_deadline, part=(i, k))
            self.leases[pid] = part
            self.stats.created += 1
            self.stats.active["held"] += 1
            heapq.heappush(self._deadlines, (part.deadline, pid))
        self._parts[lease.lease_id] = k
        self._release(lease, LeaseEvent.SPLIT, now)

    def _rearm(self, lease: Lease, now: float) -> None:
        lease.deadline = min(now + self.acquire_timeout, lease.hard_deadline)
        heapq.heappush(self._deadlines, (lease.deadline, lease.lease_id))

    def _drop_outdated_deadlines(self) -> None:
        heap = self._deadlines
        while heap:
            deadline, lease_id = heap[0]
            lease = self.leases.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                return
            heapq.heappop(heap)

    def _prune_tombstones(self, now: float) -> None:
        tombs = self._tombstones
        while tombs:
            tomb = next(iter(tombs.values()))
            if now - tomb.released_at < self.tombstone_ttl:
                return
            self._parts.pop(tombs.popitem(last=False)[0], None)
