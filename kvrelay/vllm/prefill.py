"""The prefill side of the connector, in vLLM's worker (the process that owns the KV
memory): kvrelay's lease table and relay server over vLLM's blocks.

vLLM frees a request whose ``request_finished`` returned ``delay_free=True`` only once
a worker reports it in ``finished_sending``. So while a lease lives its blocks cannot be
reused, and the lease's one release (lease.py: ``_release`` is the table's only free)
is what reports it: ``VllmLeaseBlocks.release`` queues the request id when the lease's
last block is released, and ``take_released`` hands the queue to vLLM. Each block of a
lease is released once (a second release raises), so a lease reaches zero blocks once
and its request is reported once: no dedupe of reports anywhere.

The fence's generations are the connector's own per-block counters, bumped here when
the last lease holding a block releases it: the only moment vLLM may reuse it (vLLM's
block pool lives in the scheduler process, another process than this table, so
``bind_gpu_block_pool`` could not serve the fence without a round trip per commit).
A lease still holding its blocks at RELEASE(ok) therefore always has unchanged
generations; the state check (released, or another attempt) is what refuses in
practice, the counters keep the check honest should vLLM ever free early.

The scheduler names each lease and hands its making to the worker in the step's
connector metadata (``HoldSpec``, as NixlConnector's ``reqs_to_send``): no round trip
on vLLM's scheduler thread. A lease id is ``<worker's engine id>.<sequence>.<128 random
bits>``; the worker makes them in order as its next step starts (``hold_all``, from
``bind_connector_metadata``), so an ACQUIRE that races the metadata (the params reached
D first) names a sequence number past the last one made and is answered NOT_YET
(``pending``): D asks again, within a bound. Each hold ends in exactly one
``finished_sending``: the lease's release, or at once when the lease could not be made.
A request is named in a hold only after ``request_finished`` returned
``delay_free=True`` for it, so every report names a request vLLM still holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvrelay.relay import protocol as P
from kvrelay.relay.sides import build_prefill_side
from kvrelay.relay.transports.layout import HostCache, TensorCache, head_part
from kvrelay.relay.transports.staging import StagedBlocks
from kvrelay.relay.transports.tcp import block_io
from kvrelay.vllm import faults
from kvrelay.vllm.devices import fence, kv_blocks
from kvrelay.vllm.settings import ConnectorSettings

log = logging.getLogger(__name__)


class VllmLeaseBlocks:
    """``LeaseBlocks`` over vLLM's blocks: leases own them until their one release."""

    def __init__(self, num_blocks: int, ready: threading.Event | None = None) -> None:
        self.ready = ready or threading.Event()  # set when a report is queued
        self._gen = np.zeros(num_blocks, dtype=np.int64)
        self._holds = np.zeros(num_blocks, dtype=np.int32)  # leases holding each block
        # lease id -> (request id, the blocks it still holds)
        self._leases: dict[str, tuple[str, set[int]]] = {}
        # Leases holding blocks, per request: a split lease's parts are several (lease.py),
        # and the request is reported once, when its last lease lets go.
        self._per_request: dict[str, int] = {}
        # (request, lease, the request's last lease?) of ended leases
        self._released: list[tuple[str, str, bool]] = []

    def hold(self, request_id: str, block_ids: Sequence[int], lease_id: str) -> None:
        ids = set(block_ids)
        if len(ids) != len(block_ids) or lease_id in self._leases:
            raise ValueError(f"lease {lease_id}: blocks {list(block_ids)} named twice")
        if any(not 0 <= b < len(self._gen) for b in ids):
            raise ValueError(f"lease {lease_id}: block ids outside 0..{len(self._gen) - 1}")
        # Prefix-cached blocks may be shared by two finished requests: counted per lease.
        self._holds[list(ids)] += 1
        self._leases[lease_id] = (request_id, ids)
        self._per_request[request_id] = self._per_request.get(request_id, 0) + 1

    def release(self, lease_id: str, block_ids: Sequence[int]) -> None:
        if not block_ids and lease_id not in self._leases:
            return  # every block went at ACQUIRE (a partial pull of none): reported then
        request_id, held = self._leases[lease_id]
        ids = set(block_ids)
        if not ids <= held:
            raise AssertionError(f"lease {lease_id} releases blocks it does not hold: "
                                 f"{sorted(ids - held)}")
        held -= ids
        idx = list(ids)
        self._holds[idx] -= 1
        self._gen[[b for b in idx if self._holds[b] == 0]] += 1
        if not held:
            # The lease's last block; the request's last lease: vLLM may free it now
            # (finished_sending).
            del self._leases[lease_id]
            left = self._per_request.pop(request_id) - 1
            if left:
                self._per_request[request_id] = left
            self._released.append((request_id, lease_id, not left))
            self.ready.set()

    def unheld(self, request_id: str) -> None:
        """A hold whose lease could not be made: vLLM may free the request at once."""
        self._released.append((request_id, "", True))
        self.ready.set()

    def generations(self, block_ids: Sequence[int]) -> list[int]:
        return [int(g) for g in self._gen[list(block_ids)]]

    def held(self, lease_id: str, block_ids: Sequence[int]) -> bool:
        entry = self._leases.get(lease_id)
        return entry is not None and entry[1] == set(block_ids)

    def take_released(self) -> list[tuple[str, str, bool]]:
        """(request id, lease id, whether it was the request's last) of each lease ended
        since the last call."""
        out, self._released = self._released, []
        return out


@dataclass(frozen=True)
class HoldSpec:
    """A lease the scheduler named (``request_finished``) for the worker to make."""

    request_id: str
    lease_id: str
    block_ids: list[int]
    num_tokens: int
    first_token: int
    prompt_digest: bytes


class PrefillSide:
    """Lease table + relay server, one per prefill worker."""

    def __init__(self, settings: ConnectorSettings, cache: HostCache | TensorCache,
                 compat: str, engine_id: str,
                 ready: threading.Event | None = None, worker: int = 0,
                 kv_dtype: str = "") -> None:
        self.lock = threading.Lock()
        num_blocks = cache.num_blocks
        self.blocks = VllmLeaseBlocks(num_blocks, ready)
        self._made_upto = 0  # the sequence number of the last hold taken (hold_all)
        self.kv_blocks = kv_blocks(cache, settings)
        self._part_blocks: dict[tuple[int, int], Any] = {}

        def part_blocks(i: int, k: int) -> Any:
            """tcp's reads of head slice i of k: a lease split for a decode engine of k
            times this engine's tensor-parallel workers (docs/vllm.md). Staged (a cache
            on a GPU): the whole cache's reader seen through the slice, its fences,
            copier and kept buffers shared (no memory of its own)."""
            with self.lock:
                got = self._part_blocks.get((i, k))
                if got is None:
                    part = head_part(cache, i, k)
                    whole = self.kv_blocks
                    got = self._part_blocks[i, k] = (
                        whole.view(part) if isinstance(whole, StagedBlocks)
                        and isinstance(part, TensorCache) else block_io(part))
            return got

        def splits(k: int) -> bool:  # a lease may be cut into k parts: heads split
            return "H" in cache.layout.order and cache.layout.heads % k == 0

        parts = build_prefill_side(
            self.blocks, settings.sides(worker, serve=True), engine_id=engine_id, compat=compat,
            kv_cache=cache, kv_blocks=self.kv_blocks, layout=cache.layout.name,
            kv_dtype=kv_dtype, lock=self.lock, part_blocks=part_blocks, splits=splits)
        self.table, self.server, self.nixl = parts.table, parts.server, parts.nixl
        self.table.pending = self.pending
        self.compat = compat
        self._ended: dict[str, int] = {}  # lease ends by reason since the last stats
        self.made = 0  # leases made since the last stats
        log.info("kvrelay: relay for decode engines on %s (layout %s, compat %s)",
                 self.server.address, cache.layout.name, compat)

    @property
    def engine_id(self) -> str:
        return self.table.engine_id

    def pending(self, lease_id: str) -> bool:
        """Named by our scheduler, not made yet (called under ``lock``): an id of this
        worker life whose number is past the last one made, by at most PENDING_WINDOW
        (a forged far-future id is unknown, not pending)."""
        seq = _seq_of(lease_id, self.engine_id)
        return seq is not None and self._made_upto < seq <= self._made_upto + PENDING_WINDOW

    def hold_all(self, holds: Sequence[HoldSpec]) -> None:
        """Make the leases the scheduler named for this worker (the lease id names its
        engine id), in order. One that cannot be made (a bug, or blocks outside the
        cache) fails alone: its request is reported at once."""
        faults.hold_delay()
        # With tensor parallelism every worker gets every hold: one per worker's relay.
        holds = [h for h in holds if h.lease_id.startswith(f"{self.engine_id}.")]
        # Before any lease exists: a staged READ of its blocks waits for the forward
        # passes queued so far on this (vLLM's) thread, the one that wrote them included.
        fence([self.kv_blocks], [b for h in holds for b in h.block_ids])
        now = time.monotonic()
        with self.lock:
            for h in holds:
                seq = _seq_of(h.lease_id, self.engine_id)
                if seq is not None:
                    self._made_upto = max(self._made_upto, seq)
                try:
                    faults.hit("hold", h.request_id)
                    self.table.create(h.request_id, h.block_ids, now, num_tokens=h.num_tokens,
                                      first_token=h.first_token,
                                      prompt_digest=h.prompt_digest, lease_id=h.lease_id)
                except Exception as e:
                    made = (h.lease_id in self.table.leases
                            or self.table.release_reason(h.lease_id) is not None)
                    log.warning("kvrelay: %s for request %s (%s: %s)%s",
                                "lease made, then an error" if made else "no lease",
                                h.request_id, type(e).__name__, e,
                                "" if made else ": vLLM frees it")
                    if not made:  # a made lease reports at its release
                        self.blocks.unheld(h.request_id)
                    continue
                self.made += 1
                log.debug("kvrelay: lease %s for request %s (%d blocks)", h.lease_id,
                          h.request_id, len(h.block_ids))

    def take_released(self) -> set[str]:
        with self.lock:
            released = self.blocks.take_released()
            reasons = [self.table.release_reason(lid) if lid else None
                       for _, lid, _last in released]
        for (rid, lid, last), why in zip(released, reasons, strict=True):
            name = why.value if why else "not_made"
            self._ended[name] = self._ended.get(name, 0) + 1
            log.debug("kvrelay: lease %s of request %s ended (%s)%s", lid or "-", rid, name,
                      ": its blocks return to vLLM" if last else "")
        return {rid for rid, _, last in released if last}

    def collect_stats(self, data: dict[str, Any]) -> None:
        """Leases made and ended by reason since the last call, into ``data``."""
        ended, self._ended = self._ended, {}
        for why, n in ended.items():
            data["leases_ended"][why] = data["leases_ended"].get(why, 0) + n
        made, self.made = self.made, 0
        data["leases_made"] = data.get("leases_made", 0) + made

    def close(self) -> None:
        self.server.close()
        if self.nixl is not None:
            self.nixl.close()


PENDING_WINDOW = 4096  # lease ids named ahead of the last one made that count as pending


def _seq_of(lease_id: str, engine_id: str) -> int | None:
    """The sequence number of ``<engine_id>.<n>.<random>``, or None."""
    head, _, _rand = lease_id.rpartition(".")
    prefix, _, seq = head.rpartition(".")
    if prefix != engine_id or not (seq.isascii() and seq.isdigit() and len(seq) <= 18):
        return None
    return int(seq)


def prompt_digest(prompt_token_ids: Sequence[int]) -> bytes:
    return P.prompt_digest(list(prompt_token_ids))
