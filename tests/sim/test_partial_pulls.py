"""Partial pulls (issue 13): the decode engine shares the prompt's blocks it has in its
own prefix cache and pulls only the rest; the lease covers that range from ACQUIRE on.

Hand-driven with the race harness: every event's order is the test's, the runners
refuse to sample on KV that is not the request's own (a torn or missing block raises).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvrelay.core.block_pool import request_owner
from kvrelay.core.lifecycle import Failure
from kvrelay.relay import protocol as P
from kvrelay.relay.receiver import INVALID_PARAMS, Phase, ReceiverConfig, RemoteKv
from tests.sim.race_harness import BS, Pair

PROMPT = 9  # two full blocks of 4 and one partial block


def warm(pair: Pair, prompt_len: int = PROMPT) -> None:
    """One request through P and D: D's prefix cache then holds the prompt's full blocks."""
    kv = pair.prefill("warm", prompt_len)
    pair.submit("warm", kv, prompt_len)
    pair.converse()
    assert pair.outputs["warm"] == pair.expect(1, prompt_len)[1:]


def test_d_pulls_only_the_blocks_its_cache_lacks() -> None:
    pair = Pair(caching=True)
    warm(pair)
    before = pair.rx.stats.transfer_bytes
    kv, handle = pair.start_copy("r", PROMPT)
    # ACQUIRE named the first block to pull; the lease now covers only the tail...
    lease = pair.table.leases[kv.lease_id]
    assert lease.first_block == 2 and lease.block_ids == kv.block_ids[2:]
    assert pair.table.stats.skipped_blocks == 2 and pair.rx.stats.cached_blocks == 2
    # ...whose skipped blocks went back to P's pool at once (cached: P computed them).
    assert not any(pair.p_pool.holds(b, f"lease:{kv.lease_id}") for b in kv.block_ids[:2])
    d_req = pair.d.requests["r"]
    assert handle.remote == kv.block_ids[2:] and handle.local == d_req.block_ids[2:]
    assert all(pair.d_pool.is_cached(b) is False and len(pair.d_pool.owners_of(b)) == 1
               for b in d_req.block_ids[:2])  # shared with nobody else now, pinned by r
    pair.converse()
    assert pair.outputs["r"] == pair.expect(1, PROMPT)[1:]
    assert pair.rx.stats.transfer_bytes - before == 1 * BS  # one block, not three
    assert pair.table.stats.released == {"done": 2}
    pair.assert_all_free()


def test_the_fence_covers_exactly_the_pulled_blocks() -> None:
    """The skipped blocks are P's to reuse once ACQUIRE skipped them: their generations
    may change (P evicts them) without failing the copy of the others."""
    pair = Pair(caching=True)
    warm(pair)
    kv, handle = pair.start_copy("r", PROMPT)
    skipped = kv.block_ids[:2]
    # P fills its pool with other work: the skipped (cached) blocks get evicted.
    hog_len = (pair.p_pool.num_free + pair.p_pool.num_cached) * BS - 1
    pair.p.add_request("hog", [7] * hog_len, pair.params(9, 1))
    for _ in range(50):
        pair.p.step()
    assert not pair.p.has_work()
    assert all(pair.p_pool.generation(b) > 0 for b in skipped)
    pair.transport.land(handle)
    pair.transport.finish(handle)
    pair.converse()
    assert pair.outputs["r"] == pair.expect(1, PROMPT)[1:]
    assert pair.table.stats.released == {"done": 2}
    pair.assert_all_free()


def test_abort_during_a_partial_pull_keeps_the_shared_blocks_intact() -> None:
    """A client abort mid-copy drains the pulled block; the shared prefix blocks, which
    no transfer writes, return to the cache and a later request decodes on them."""
    pair = Pair(caching=True)
    warm(pair)
    kv, handle = pair.start_copy("r", PROMPT)
    shared = pair.d.requests["r"].block_ids[:2]
    pair.rx.abort("r", pair.now)
    assert pair.rx.loads["r"].phase is Phase.DRAINING
    pair.transport.land(handle)  # the block in flight still lands, into r's own block
    pair.transport.finish(handle, ok=False)
    pair.converse()
    assert "r" not in pair.d.requests and all(pair.d_pool.is_cached(b) for b in shared)
    kv = pair.prefill("s", PROMPT)
    pair.submit("s", kv, PROMPT)
    pair.converse()
    assert pair.outputs["s"] == pair.expect(1, PROMPT)[1:]
    assert pair.table.stats.released == {"done": 2, "aborted": 1}
    pair.assert_all_free()


def test_a_partial_pull_deaf_to_cancel_quarantines_only_the_pulled_blocks() -> None:
    pair = Pair(caching=True)
    pair.rx.config = ReceiverConfig(rto=1.0, peer_timeout=10.0, copy_timeout=30.0,
                                    heartbeat_interval=2.0, drain_timeout=1.0)
    warm(pair)
    _, handle = pair.start_copy("r", PROMPT)
    shared = pair.d.requests["r"].block_ids[:2]
    pulled = pair.d.requests["r"].block_ids[2:]
    pair.rx.abort("r", pair.now)
    pair.now += 1.5  # past the drain bound: the transport has not stopped
    pair.tick()
    assert pair.d_pool.owners().get("quarantine:r") == len(pulled)
    assert all(pair.d_pool.holds(b, "quarantine:r") for b in pulled)
    assert all(not pair.d_pool.holds(b, "quarantine:r") for b in shared)
    pair.converse()
    assert all(pair.d_pool.is_cached(b) for b in shared)
    pair.transport.land(handle)  # the late write lands in quarantine, seen by nobody
    pair.transport.finish(handle, ok=False)
    pair.tick()
    assert "quarantine:r" not in pair.d_pool.owners()
    pair.assert_all_free()


@pytest.mark.parametrize("d_async", [False, True])
def test_eviction_on_d_while_a_partial_pull_is_in_flight(d_async: bool) -> None:
    """Local work on D needs every free and cached block while r pulls its tail: the
    LRU evicts what nobody holds, never r's shared prefix (r holds a reference), so
    r decodes on its own KV and the evicted blocks' generations moved on."""
    pair = Pair(caching=True, d_async=d_async)
    warm(pair, prompt_len=PROMPT)
    other = pair.prefill("other", 13)  # a different prompt length: other cached blocks
    pair.submit("other", other, 13, seed=1)
    pair.converse()
    cached_before = pair.d_pool.num_cached
    _, handle = pair.start_copy("r", PROMPT)
    shared = pair.d.requests["r"].block_ids[:2]
    evictions = pair.d_pool.num_evictions
    hog_len = (pair.d_pool.num_free + pair.d_pool.num_cached) * BS - 1
    pair.d.add_request("hog", [5] * hog_len, pair.params(3, 1))
    pair.step_d()
    assert pair.d_pool.num_evictions > evictions and cached_before > 2
    assert all(pair.d_pool.holds(b, request_owner("r")) for b in shared)
    pair.transport.land(handle)
    pair.transport.finish(handle)
    pair.converse()
    assert pair.outputs["r"] == pair.expect(1, PROMPT)[1:]
    pair.assert_all_free()


@pytest.mark.parametrize("forgery", ["first_token", "lease_id"])
def test_forged_params_fail_even_when_every_block_is_cached(forgery: str) -> None:
    """Nothing to pull, yet the params are checked against the lease before D decodes:
    a forged first token (or lease) is the client's error, never decoded."""
    pair = Pair(caching=True)
    warm(pair, prompt_len=8)
    kv = pair.prefill("r", prompt_len=8)
    forged = dataclasses.replace(kv, **{"first_token": (kv.first_token + 1) % 997}
                                 if forgery == "first_token" else {"lease_id": "f" * 32})
    pair.submit("r", forged, prompt_len=8)
    pair.converse()
    assert pair.finished["r"].error.startswith(INVALID_PARAMS), pair.finished["r"].error
    assert pair.finished["r"].failure is Failure.KV_PARAMS  # the server's 400
    assert "r" not in pair.outputs or pair.outputs["r"] == []
    pair.now += 10.0  # the genuine lease, never consumed, expires (forged lease id)
    pair.table.expire(pair.now)
    pair.assert_all_free()


def test_an_acquire_outside_the_lease_is_refused() -> None:
    pair = Pair(caching=True)
    kv = pair.prefill("r", PROMPT)
    for first in (len(kv.block_ids) + 1, -1):
        reply = pair.relay.handle(P.Acquire(1, kv.engine_id, kv.lease_id, "d1", "x", first),
                                  pair.now)
        assert (reply.status, reply.code) == ("error", P.ErrorCode.BAD_RANGE.value)
    assert kv.lease_id in pair.table.leases  # still HELD, whole, for its real decoder
    assert pair.table.leases[kv.lease_id].block_ids == kv.block_ids


def test_kv_from_an_untrusted_relay_is_never_published() -> None:
    """A relay D cannot authenticate (no secret, not on this host) may be a forgery the
    client named: its KV serves the request that asked for it and nobody else."""
    pair = Pair(caching=True)
    pair.relay_trusted = False
    warm(pair)  # pulled from the untrusted relay: nothing published on D
    assert pair.d_pool.num_cached == 0
    kv, _ = pair.start_copy("r", PROMPT)
    assert pair.table.leases[kv.lease_id].first_block == 0  # no hit: a whole pull
    pair.converse()
    assert pair.outputs["r"] == pair.expect(1, PROMPT)[1:]
    assert pair.d_pool.num_cached == 0
    pair.assert_all_free()


def test_a_genuine_lease_of_another_prompt_neither_decodes_nor_poisons_the_cache() -> None:
    """Review finding: a client with a genuine lease for prompt Y sent prompt X (same
    length) to D with Y's params; D pulled Y's KV, published it under X's hashes, and
    every later request starting with X decoded on Y's KV. The lease now carries its
    prompt's digest: D refuses it (the client's error) and publishes nothing."""
    pair = Pair(caching=True)
    x = pair.prompt(PROMPT)
    y = [(7 * i + 5) % 997 for i in range(PROMPT)]
    pair.p.add_request("y", y, pair.params(1), remote_decode=True)
    for _ in range(20):
        pair.p.step()
    kv_y = RemoteKv.from_dict(pair.relay.kv_params.pop("y").to_dict())
    pair.rx.submit("evil", x, pair.params(1), kv_y, pair.now)
    pair.converse()
    error = pair.finished["evil"].error
    assert error.startswith(INVALID_PARAMS) and "another prompt" in error, error
    assert pair.finished["evil"].failure is Failure.KV_PARAMS
    assert pair.d_pool.num_cached == 0 and not pair.transport.handles
    kv = pair.prefill("honest", PROMPT)  # an honest request with prompt X decodes right
    pair.submit("honest", kv, PROMPT)
    pair.converse()
    assert pair.outputs["honest"] == pair.expect(1, PROMPT)[1:]
    pair.assert_all_free()
