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

The scheduler makes a lease through ``HoldServer``: a local socket (AF_UNIX, in a
0700 directory, authenticated by a key the worker hands the scheduler in vLLM's
handshake metadata) answering ``hold`` synchronously, so the lease exists before
``request_finished`` returns the params to the client: no ACQUIRE can find it missing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from typing import Any

import numpy as np

from kvrelay.relay import protocol as P
from kvrelay.relay.prefill import KvTransferParams
from kvrelay.relay.sides import build_prefill_side
from kvrelay.relay.transports.layout import BlockLayout
from kvrelay.relay.transports.tcp import HostBlocks
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
        self._released: list[tuple[str, str]] = []  # (request, lease) of ended leases

    def hold(self, request_id: str, block_ids: Sequence[int], lease_id: str) -> None:
        ids = set(block_ids)
        if len(ids) != len(block_ids) or lease_id in self._leases:
            raise ValueError(f"lease {lease_id}: blocks {list(block_ids)} named twice")
        if any(not 0 <= b < len(self._gen) for b in ids):
            raise ValueError(f"lease {lease_id}: block ids outside 0..{len(self._gen) - 1}")
        # Prefix-cached blocks may be shared by two finished requests: counted per lease.
        self._holds[list(ids)] += 1
        self._leases[lease_id] = (request_id, ids)

    def release(self, lease_id: str, block_ids: Sequence[int]) -> None:
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
            # The lease's last block: vLLM may free the request now (finished_sending).
            del self._leases[lease_id]
            self._released.append((request_id, lease_id))
            self.ready.set()

    def generations(self, block_ids: Sequence[int]) -> list[int]:
        return [int(g) for g in self._gen[list(block_ids)]]

    def held(self, lease_id: str, block_ids: Sequence[int]) -> bool:
        entry = self._leases.get(lease_id)
        return entry is not None and entry[1] == set(block_ids)

    def take_released(self) -> list[tuple[str, str]]:
        """(request id, lease id) of each lease ended since the last call."""
        out, self._released = self._released, []
        return out


@dataclass(frozen=True)
class HoldAddress:
    """Where the scheduler asks the worker for leases (handed over in the handshake)."""

    path: str
    authkey: bytes


class PrefillSide:
    """Lease table + relay server + hold server, one per prefill worker."""

    def __init__(self, settings: ConnectorSettings, regions: list[np.ndarray],
                 layout: BlockLayout, compat: str, engine_id: str,
                 ready: threading.Event | None = None) -> None:
        self.lock = threading.Lock()
        num_blocks = int(regions[0].shape[0])
        self.blocks = VllmLeaseBlocks(num_blocks, ready)
        parts = build_prefill_side(
            self.blocks, settings.sides(), engine_id=engine_id, compat=compat,
            kv_cache=regions, kv_blocks=HostBlocks(regions), layout=layout.name,
            lock=self.lock)
        self.table, self.server, self.nixl = parts.table, parts.server, parts.nixl
        self.compat = compat
        self._ended: dict[str, int] = {}  # lease ends by reason since the last stats
        self.hold_server = HoldServer(self)
        log.info("kvrelay: relay for decode engines on %s (layout %s, compat %s)",
                 self.server.address, layout.name, compat)

    def hold(self, request_id: str, block_ids: list[int], num_tokens: int, first_token: int,
             prompt_digest: bytes) -> dict[str, Any]:
        with self.lock:
            lease = self.table.create(request_id, block_ids, time.monotonic(),
                                      num_tokens=num_tokens, first_token=first_token,
                                      prompt_digest=prompt_digest)
        # The relay's expiry thread looks again within 1 s: a deadline is never missed
        # by more than that.
        params = KvTransferParams(lease.lease_id, self.server.address, self.table.engine_id,
                                  list(lease.block_ids), num_tokens, first_token, self.compat)
        log.info("kvrelay: lease %s for request %s (%d blocks)", lease.lease_id, request_id,
                 len(block_ids))
        return params.to_dict()

    def take_released(self) -> set[str]:
        with self.lock:
            released = self.blocks.take_released()
            reasons = [self.table.release_reason(lid) for _, lid in released]
        for (rid, lid), why in zip(released, reasons, strict=True):
            name = why.value if why else "?"
            self._ended[name] = self._ended.get(name, 0) + 1
            log.info("kvrelay: lease %s of request %s ended (%s): its blocks return to vLLM",
                     lid, rid, name)
        return {rid for rid, _ in released}

    def collect_stats(self, data: dict[str, Any]) -> None:
        """Lease ends by reason since the last call, into ``data`` (KvRelayStats)."""
        ended, self._ended = self._ended, {}
        for why, n in ended.items():
            data["leases_ended"][why] = data["leases_ended"].get(why, 0) + n

    def close(self) -> None:
        self.hold_server.close()
        self.server.close()
        if self.nixl is not None:
            self.nixl.close()


class HoldServer:
    """Answers the scheduler's ``("hold", request_id, block_ids, num_tokens, first_token,
    prompt_digest)`` with ``("ok", params)`` or ``("error", message)``."""

    def __init__(self, side: PrefillSide) -> None:
        self.side = side
        folder = self._folder = tempfile.mkdtemp(prefix="kvrelay-vllm-")  # 0700: this user
        self.address = HoldAddress(os.path.join(folder, "hold.sock"), secrets.token_bytes(32))
        self._listener = Listener(self.address.path, "AF_UNIX", authkey=self.address.authkey)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="kvrelay-hold").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:  # a failed handshake (wrong key) or the listener closed
                if self._closed:
                    return
                log.warning("kvrelay: refused a hold connection", exc_info=True)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="kvrelay-hold-conn").start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    kind, rid, block_ids, num_tokens, first_token, digest = msg
                    if kind != "hold":
                        raise ValueError(f"unknown request {kind!r}")
                    reply: tuple[str, Any] = ("ok", self.side.hold(
                        rid, list(block_ids), num_tokens, first_token, digest))
                except Exception as e:  # one bad hold fails that request only
                    log.exception("kvrelay: hold failed")
                    reply = ("error", f"{type(e).__name__}: {e}")
                conn.send(reply)

    def close(self) -> None:
        self._closed = True
        self._listener.close()  # unlinks the socket
        with contextlib.suppress(OSError):
            os.rmdir(self._folder)


def prompt_digest(prompt_token_ids: Sequence[int]) -> bytes:
    return P.prompt_digest(list(prompt_token_ids))
