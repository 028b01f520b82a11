"""The connector's worker halves (kvrelay.vllm.prefill / decode) over real sockets, on
caches cut as vLLM's CPU cache is (layer-major views of one storage), without vLLM."""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvrelay.relay.prefill import KvTransferParams
from kvrelay.relay.receiver import Phase
from kvrelay.relay.transports import nixl
from kvrelay.relay.transports.base import TransferState
from kvrelay.relay.transports.layout import (
    head_part,
    layer_cache,
    named_as,
    tensor_cache,
    widened,
)
from kvrelay.relay.transports.staging import HostCopier, StagedBlocks
from kvrelay.vllm import faults
from kvrelay.vllm.decode import (
    RANK_FIELDS,
    DecodeSide,
    LoadSpec,
    MappedDecode,
    VllmKvLoads,
    mapped_size,
    p_ranks_refused,
    trusts,
)
from kvrelay.vllm.prefill import HoldSpec, PrefillSide, VllmLeaseBlocks, prompt_digest
from kvrelay.vllm.settings import ConnectorSettings, parse_cpus

LAYERS, BLOCKS, HEADS, BS, HEAD = 3, 16, 2, 4, 8
PROMPT = list(range(100, 110))  # 10 tokens: 3 blocks of 4


def vllm_like_cache(fill: bool) -> dict[str, torch.Tensor]:
    storage = (torch.randn if fill else torch.zeros)(LAYERS, BLOCKS, HEADS, BS, 2 * HEAD)
    return {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(LAYERS)}


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[Any, ...]]]:
    made: list[Any] = []

    def make(lease_timeout: float = 5.0, lease_max: float = 60.0, delay: float = 0.0,
             transport: str = "tcp", d_lease_timeout: float | None = None,
             staged: bool = False, **extra: Any) -> tuple[Any, ...]:
        if delay:
            monkeypatch.setenv("KVRELAY_FAULT_TRANSFER_DELAY_S", str(delay))
        settings = ConnectorSettings(lease_timeout=lease_timeout, lease_max=lease_max,
                                     kv_transport=transport)
        d_settings = ConnectorSettings(
            lease_timeout=d_lease_timeout or lease_timeout,
            lease_max=max(lease_max, d_lease_timeout or 0), kv_transport=transport, **extra)
        p_cache, d_cache = vllm_like_cache(True), vllm_like_cache(False)
        # staged: the caches as a GPU's would be handed over (layout.TensorCache), on
        # CPU tensors: tcp stages them through host buffers on both sides.
        cache = tensor_cache if staged else layer_cache
        p = PrefillSide(settings, cache(p_cache), "c0", "P1")
        d = DecodeSide(d_settings, cache(d_cache), "c0", "D1")
        made.extend([p, d])
        return p, d, p_cache, d_cache

    yield make
    for side in made:
        side.close()


_lease_seq = itertools.count(1)


def name_lease(p: PrefillSide, rid: str = "p-req", blocks: list[int] | None = None
               ) -> tuple[HoldSpec, dict[str, Any]]:
    """What P's scheduler does in request_finished: a lease id, the hold for the worker
    and the params for the client (the lease is made by ``p.hold_all``)."""
    lid = f"{p.engine_id}.{next(_lease_seq)}.{secrets.token_hex(16)}"
    blocks = blocks or [5, 2, 3]
    hold = HoldSpec(rid, lid, blocks, len(PROMPT), 42, prompt_digest(PROMPT))
    params = KvTransferParams(lid, p.server.address, p.engine_id, blocks, len(PROMPT), 42,
                              p.compat).to_dict()
    return hold, params


def lease(p: PrefillSide, rid: str = "p-req") -> dict[str, Any]:
    hold, params = name_lease(p, rid)
    p.hold_all([hold])
    return params


def empty_stats() -> dict[str, Any]:
    return {"load_ms": [], "load_bytes": [], "fallbacks": {}, "fence_refused": 0,
            "leases_ended": {}, "leases_made": 0, "quarantined": 0}


def finished(d: DecodeSide, got: dict[str, bool]) -> Callable[[], bool]:
    def check() -> bool:
        done, failed = d.take_finished()
        for rid in done:
            assert rid not in got, f"{rid} reported twice"
            got[rid] = rid in failed
        return bool(got)
    return check


def test_vllm_cpu_cache_keeps_its_regions_name() -> None:
    layout = layer_cache(vllm_like_cache(False)).layout
    assert layout.name == f"regions:{LAYERS}x{HEADS * BS * 2 * HEAD * 4}"
    assert layout.order == "LBHNC"


needs_nixl = pytest.mark.skipif(not nixl.available(), reason=nixl.INSTALL_HINT)
TRANSPORTS = ["tcp", pytest.param("nixl", marks=needs_nixl)]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_pull_lands_every_layer_and_releases_once(pair: Any, transport: str) -> None:
    p, d, p_cache, d_cache = pair(transport=transport)
    params = lease(p)
    d.start([LoadSpec("d-req", params, PROMPT, [9, 10, 1], 0)], [])
    got: dict[str, bool] = {}
    wait_for(finished(d, got), "the load's report")
    assert got == {"d-req": False}
    for name in p_cache:
        assert torch.equal(d_cache[name][[9, 10, 1]], p_cache[name][[5, 2, 3]])
    released: set[str] = set()
    wait_for(lambda: bool(released.update(p.take_released()) or released), "the release")
    assert released == {"p-req"}
    time.sleep(0.2)
    assert p.take_released() == set() and d.take_finished() == (set(), set())
    stats = empty_stats()
    p.collect_stats(stats)
    d.collect_stats(stats)
    assert len(stats.pop("load_ms")) == 1
    assert stats.pop("load_bytes") == [3 * sum(t[0].nbytes for t in p_cache.values())]
    assert stats == {"fallbacks": {}, "fence_refused": 0, "leases_ended": {"done": 1},
                     "leases_made": 1, "quarantined": 0}


def test_a_gpu_cache_is_staged_and_its_blocks_fenced_before_lease_and_load(
        pair: Any) -> None:
    """The ordering of a GPU cache's copies after the forward passes: P takes its fence
    mark on vLLM's thread before the lease exists (so before any READ of it can come),
    D before the load is queued, and each side's staged copies wait for that mark."""
    p, d, p_cache, d_cache = pair(staged=True)
    assert isinstance(p.kv_blocks, StagedBlocks) and isinstance(d.kv_blocks, StagedBlocks)
    seen: list[tuple[str, Any]] = []

    class Watch(HostCopier):
        def __init__(self, side: str) -> None:
            self.side = side

        def now(self) -> Any:
            seen.append((f"{self.side} mark", sorted(p.table.leases)))
            return self.side

        def after(self, marks: Any) -> None:
            seen.append((f"{self.side} waits", list(marks)))

    p.kv_blocks.copier, d.kv_blocks.copier = Watch("P"), Watch("D")
    hold, params = name_lease(p)
    p.hold_all([hold])
    assert seen == [("P mark", [])]  # taken while no lease existed
    d.start([LoadSpec("d-req", params, PROMPT, [9, 10, 1], 0)], [])
    got: dict[str, bool] = {}
    wait_for(finished(d, got), "the load's report")
    assert got == {"d-req": False}
    assert seen[1] == ("D mark", [hold.lease_id])
    assert ("P waits", ["P"]) in seen and ("D waits", ["D"]) in seen
    for name in p_cache:
        assert torch.equal(d_cache[name][[9, 10, 1]], p_cache[name][[5, 2, 3]])


def test_a_tcp_transfer_wakes_the_receiver_once_its_status_is_final(pair: Any) -> None:
    """The receiver thread acts on a transfer's end at once (not at its next poll):
    the transport calls on_end once per transfer, after the status stopped changing."""
    p, d, _, _ = pair()
    ends: list[TransferState] = []
    wake = d.transport.on_end
    d.transport.on_end = lambda h: (ends.append(h.status.state), wake(h))
    d.start([LoadSpec("d-req", lease(p), PROMPT, [9, 10, 1], 0)], [])
    got: dict[str, bool] = {}
    wait_for(finished(d, got), "the load's report")
    assert got == {"d-req": False} and ends == [TransferState.DONE]


def test_a_replay_never_commits(pair: Any) -> None:
    p, d, _, _ = pair()
    params = lease(p)
    d.start([LoadSpec("first", params, PROMPT, [9, 10, 1], 0)], [])
    got: dict[str, bool] = {}
    wait_for(finished(d, got), "the first load")
    d.start([LoadSpec("replay", params, PROMPT, [11, 12, 13], 0)], [])
    got.clear()
    wait_for(finished(d, got), "the replay's report")
    assert got == {"replay": True}  # failed_recving: vLLM recomputes it


def test_params_of_another_prompt_are_refused(pair: Any) -> None:
    p, d, _, _ = pair()
    other = list(reversed(PROMPT))
    d.start([LoadSpec("d-req", lease(p), other, [9, 10, 1], 0)], [])
    got: dict[str, bool] = {}
    wait_for(finished(d, got), "the report")
    assert got == {"d-req": True}


def test_expiry_while_the_pull_is_delayed_falls_back(pair: Any) -> None:
    # Heartbeats keep a pulling lease alive up to its hard cap: the cap ends it here.
    p, d, _, _ = pair(lease_timeout=0.5, lease_max=1.0, delay=2.0)
    d.start([LoadSpec("d-req", lease(p), PROMPT, [9, 10, 1], 0)], [])
    released: set[str] = set()
    wait_for(lambda: bool(released.update(p.take_released()) or released), "expiry")
    got: dict[str, bool] = {}
    wait_for(finished(d, got), "the fallback")
    assert got == {"d-req": True}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_blocks_reused_under_a_delayed_copy_never_commit(pair: Any, transport: str) -> None:
    """P's lease expires while D's copy is held back (D heartbeats later than P's
    timeout: a stalled D), and P's blocks get other requests' KV. Over tcp P refuses the
    READ; over nixl the READ is one-sided and copies the new bytes (a torn copy): the
    commit is refused (the fence), and either way vLLM is told to recompute."""
    p, d, p_cache, d_cache = pair(lease_timeout=0.5, delay=1.5, transport=transport,
                                  d_lease_timeout=30.0)
    d.start([LoadSpec("d-req", lease(p), PROMPT, [9, 10, 1], 0)], [])
    released: set[str] = set()
    wait_for(lambda: bool(released.update(p.take_released()) or released), "expiry")
    for t in p_cache.values():  # vLLM hands the freed blocks to other requests
        t[[5, 2, 3]] = 7.0
    got: dict[str, bool] = {}
    wait_for(finished(d, got), "the fallback")
    assert got == {"d-req": True}  # finished_recving + failed_recving: recompute
    stats = empty_stats()
    d.collect_stats(stats)  # what vLLM's stat logger prints as KV Transfer metrics
    if transport == "nixl":
        assert all(torch.all(t[[9, 10, 1]] == 7.0) for t in d_cache.values()), "not torn"
        assert stats["fence_refused"] == 1 and stats["fallbacks"] == {"fence_failed": 1}
    else:
        assert stats["fence_refused"] == 0 and stats["fallbacks"] == {"transfer_failed": 1}
        assert not any(torch.any(t[[9, 10, 1]] != 0) for t in d_cache.values())


def test_abort_while_the_pull_waits_reports_once_after_it_stopped(pair: Any) -> None:
    p, d, _, _ = pair(delay=30.0)
    d.start([LoadSpec("d-req", lease(p), PROMPT, [9, 10, 1], 0)], [])
    wait_for(lambda: getattr(d.receiver.loads.get("d-req"), "phase", None) is Phase.COPYING,
             "the copy")
    d.start([], ["d-req"])
    got: dict[str, bool] = {}
    wait_for(finished(d, got), "the abort's report")
    assert set(got) == {"d-req"}
    released: set[str] = set()
    wait_for(lambda: bool(released.update(p.take_released()) or released), "P's release")
    assert released == {"p-req"}
    d.start([], ["d-req"])  # a second abort (vLLM's duplicate request_finished): nothing
    time.sleep(0.2)
    assert d.take_finished() == (set(), set())


def test_a_lease_never_loaded_is_given_back_at_once(pair: Any) -> None:
    p, d, _, _ = pair(lease_timeout=30.0)
    params = lease(p)
    d.start([], [], [params])  # vLLM's rejection path: request_finished, no load
    released: set[str] = set()
    wait_for(lambda: bool(released.update(p.take_released()) or released), "P's release",
             timeout=10.0)  # well before the 30 s timeout
    assert released == {"p-req"}
    assert p.table.release_reason(params["lease_id"]).value == "aborted"


def test_lease_blocks_shared_prefix_and_one_report() -> None:
    blocks = VllmLeaseBlocks(8)
    blocks.hold("a", [1, 2], "L1")
    blocks.hold("b", [1, 3], "L2")  # block 1: a prefix both requests share
    g = blocks.generations([1, 2, 3])
    blocks.release("L1", [1])  # a partial pull's leading block
    assert blocks.generations([1, 2, 3]) == g and blocks.take_released() == []
    blocks.release("L1", [2])
    assert blocks.take_released() == [("a", "L1", True)]
    assert blocks.generations([1, 2, 3]) == [g[0], g[1] + 1, g[2]]  # 1 is still L2's
    with pytest.raises(KeyError):
        blocks.release("L1", [2])  # the lease is gone: a second release cannot report
    blocks.release("L1", [])  # its table's final release after a pull of no blocks
    assert blocks.take_released() == []
    blocks.release("L2", [1, 3])
    assert blocks.take_released() == [("b", "L2", True)]
    assert blocks.generations([1, 3]) == [g[0] + 1, g[2] + 1]


def test_a_split_leases_parts_report_their_request_once_after_the_last() -> None:
    """A lease cut into parts (lease.py, Parts): the parts hold the blocks before the
    lease lets go; its request is reported once, at its last part's end, and the blocks'
    generations move only then."""
    blocks = VllmLeaseBlocks(8)
    blocks.hold("a", [1, 2], "L")
    g = blocks.generations([1, 2])
    for i in range(2):
        blocks.hold("a", [1, 2], f"L/{i}/2")
    blocks.release("L", [1, 2])
    blocks.release("L/0/2", [1, 2])
    assert blocks.take_released() == [("a", "L", False), ("a", "L/0/2", False)]
    assert blocks.generations([1, 2]) == g  # L/1/2 still holds them
    blocks.release("L/1/2", [2])  # a partial pull's leading block... and the rest
    blocks.release("L/1/2", [1])
    assert blocks.take_released() == [("a", "L/1/2", True)]
    assert blocks.generations([1, 2]) == [g[0] + 1, g[1] + 1]


def test_kv_loads_quarantine_defers_the_report() -> None:
    loads = VllmKvLoads()
    loads.expect("r", [1, 2], 0)
    loads.admit("r", [1], None, eos_token_ids=(), remote_kv=None, first_token=0)  # type: ignore[arg-type]
    loads.quarantine("r")
    loads.load_failed("r", "stopped", recompute=True)
    assert loads.take() == (set(), set())  # the transfer may still write: blocks stay
    loads.unquarantine("r", [])
    assert loads.take() == ({"r"}, {"r"})
    with pytest.raises(KeyError):
        loads.load_done("r", shareable=True)


def test_settings_name_the_bad_key() -> None:
    assert ConnectorSettings.from_extra({"lease_timeout": 3, "relay_port": 0}).lease_timeout == 3
    with pytest.raises(ValueError, match=r"unknown key.*lease_tmeout"):
        ConnectorSettings.from_extra({"lease_tmeout": 3})
    with pytest.raises(ValueError, match="kv_transport 'shm'"):
        ConnectorSettings.from_extra({"kv_transport": "shm"})
    with pytest.raises(ValueError, match="relay_port must be int"):
        ConnectorSettings.from_extra({"relay_port": "80"})


def test_importing_kvrelay_never_imports_vllm() -> None:
    """Where vLLM is absent an import of it would fail; in the vLLM venv (when present)
    it would land in sys.modules: both fail this test."""
    from tests.vllm.pair import PYTHON, REPO

    code = ("import sys, kvrelay, kvrelay.vllm, kvrelay.vllm.prefill, kvrelay.vllm.decode, "
            "kvrelay.relay.server, kvrelay.proxy.app; "
            "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if 'vllm' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)
    if PYTHON.exists():
        subprocess.run([str(PYTHON), "-c", code],
                       check=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_docs_list_every_setting_with_its_default() -> None:
    import dataclasses
    import json
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "vllm.md").read_text()
    table = text[text.index("## Settings"):text.index("`kv_load_failure_policy`:")]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", table, re.M))
    fields = {f.name: f.default for f in dataclasses.fields(ConnectorSettings)}
    assert set(rows) == set(fields)
    for name, default in fields.items():
        if default is None:
            continue
        want = (json.dumps(default) if isinstance(default, bool) or default == ""
                else f"{default:g}" if isinstance(default, float) else str(default))
        assert rows[name].strip("` ") == want, name


def released_by(p: PrefillSide, n: int, timeout: float = 10.0) -> set[str]:
    out: set[str] = set()
    wait_for(lambda: bool(out.update(p.take_released())) or len(out) >= n, "P's releases",
             timeout)
    return out


def test_an_acquire_before_the_lease_is_made_waits_for_it(pair: Any) -> None:
    """P's scheduler hands the params out a step before its worker makes the lease: D's
    ACQUIRE meets NOT_YET and asks again until the lease exists, then pulls."""
    p, d, p_cache, d_cache = pair()
    hold, params = name_lease(p)
    d.start([LoadSpec("d-req", params, PROMPT, [9, 10, 1], 0)], [])
    wait_for(lambda: getattr(d.receiver.loads.get("d-req"), "not_yet", 0) >= 2, "NOT_YET")
    assert d.take_finished() == (set(), set())
    p.hold_all([hold])
    got: dict[str, bool] = {}
    wait_for(finished(d, got), "the load's report")
    assert got == {"d-req": False}
    assert all(torch.equal(d_cache[n][[9, 10, 1]], p_cache[n][[5, 2, 3]]) for n in p_cache)
    assert released_by(p, 1) == {"p-req"}


def test_a_lease_made_after_d_gave_up_is_freed_at_once(pair: Any) -> None:
    """D's NOT_YET bound passes: D recomputes and tells P ABORT; P frees the lease the
    moment its worker makes it, not at its timeout."""
    p, d, _, _ = pair(lease_timeout=30.0)
    d.receiver.config = dataclasses.replace(d.receiver.config, not_yet_timeout=0.3)
    hold, params = name_lease(p)
    d.start([LoadSpec("d-req", params, PROMPT, [9, 10, 1], 0)], [])
    got: dict[str, bool] = {}
    wait_for(finished(d, got), "the fallback")
    assert got == {"d-req": True}
    wait_for(lambda: len(p.table._aborted_early) == 1, "P to hear the ABORT")
    p.hold_all([hold])
    assert released_by(p, 1, timeout=1.0) == {"p-req"}
    assert p.table.release_reason(params["lease_id"]).value == "aborted"


def test_a_hold_that_cannot_be_made_is_reported_alone(pair: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One hold of a step fails (blocks outside the cache; an injected fault): its
    request is reported at once, the others get their leases."""
    p, _, _, _ = pair()
    bad, _ = name_lease(p, "bad", blocks=[99])
    faulty, _ = name_lease(p, "faulty")
    good, params = name_lease(p, "good", blocks=[7, 8, 9])
    faults._counts.clear()
    monkeypatch.setenv("KVRELAY_FAULT_VLLM_RAISE", "hold:2")
    p.hold_all([bad, faulty, good])
    assert p.take_released() == {"bad", "faulty"}
    assert params["lease_id"] in p.table.leases
    stats = empty_stats()
    p.collect_stats(stats)
    assert stats["leases_ended"] == {"not_made": 2} and stats["leases_made"] == 1


@pytest.mark.parametrize("point", ["submit", "reply"])
def test_an_exception_in_the_receiver_fails_that_load_alone(
        pair: Any, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """The second load's submit (or the reply to its ACQUIRE) raises: that load alone is
    reported failed (vLLM recomputes it), the batch's others pull, and P's leases all
    end (the failed one told ABORT, not left to its timeout)."""
    p, d, _, _ = pair(lease_timeout=30.0)
    specs = [LoadSpec(f"d{i}", lease(p, f"p{i}"), PROMPT, [i, i + 1, i + 2], 0)
             for i in range(0, 9, 3)]
    faults._counts.clear()
    monkeypatch.setenv("KVRELAY_FAULT_VLLM_RAISE", f"{point}:2")
    d.start(specs, [])
    got: dict[str, bool] = {}
    wait_for(lambda: bool(finished(d, got)()) and len(got) == 3, "three reports")
    assert sorted(got.values()) == [False, False, True] and d.errors == 1
    assert released_by(p, 3, timeout=5.0) == {"p0", "p3", "p6"}


def test_a_client_named_relay_elsewhere_is_never_dialled(pair: Any) -> None:
    """No secret: a relay on another host could plant KV in vLLM's prefix cache, so the
    load is refused (recompute) before any dial, and no ABORT goes there either."""
    p, d, _, _ = pair()
    params = dict(lease(p), relay="relay.invalid:7100")
    d.start([LoadSpec("d-req", params, PROMPT, [9, 10, 1], 0)], [], [params])
    got: dict[str, bool] = {}
    wait_for(finished(d, got), "the refusal")
    assert got == {"d-req": True} and not d.client._peers
    s = ConnectorSettings()
    assert not trusts(s, "relay.invalid:7100") and not trusts(s, "192.0.2.1:7100")
    assert trusts(s, "127.0.0.1:7100") and trusts(s, "localhost:7100")
    assert trusts(ConnectorSettings(relay_secret="k"), "relay.invalid:7100")
    assert trusts(ConnectorSettings(trust_unauthenticated_relays=True), "relay.invalid:7100")


def test_vllms_step_never_waits_for_the_receiver_lock(pair: Any) -> None:
    """The receiver thread holds its lock across a READ post or a dial; vLLM's
    get_transfer_results and stats take only the report lock."""
    _, d, _, _ = pair()
    import threading

    done = threading.Event()

    def step() -> None:
        d.take_finished()
        d.collect_stats(empty_stats())
        done.set()

    with d.lock:
        threading.Thread(target=step, daemon=True).start()
        assert done.wait(10.0), "vLLM's step waited on the receiver lock"


def test_relay_cpus_parse() -> None:
    assert parse_cpus("0-2,5") == {0, 1, 2, 5} and parse_cpus("") == set()
    with pytest.raises(ValueError, match="relay_cpus"):
        ConnectorSettings(relay_cpus="3-1")
    assert ConnectorSettings.from_extra({"trust_unauthenticated_relays": True}
                                        ).trust_unauthenticated_relays
    with pytest.raises(ValueError, match="trust_unauthenticated_relays must be bool"):
        ConnectorSettings.from_extra({"trust_unauthenticated_relays": "yes"})


def test_pending_means_named_by_this_worker_life_and_not_made_yet(pair: Any) -> None:
    p, _, _, _ = pair()
    hold, params = name_lease(p)
    lid, eid = params["lease_id"], p.engine_id
    with p.lock:
        assert p.pending(lid)
        assert not p.pending(f"{eid}.{10**6}.ab")  # far ahead: a forgery, not pending
        assert not p.pending(f"{eid}.\u00b2.ab") and not p.pending("other.1.ab")
        assert not p.pending(f"{eid}.{'9' * 5000}.ab")  # no int() of a huge string
    p.hold_all([hold])
    with p.lock:
        assert not p.pending(lid) and lid in p.table.leases


def test_an_acquire_of_no_blocks_ends_the_lease_once(pair: Any) -> None:
    """A partial pull of none (every block in D's cache): the lease's blocks all go at
    ACQUIRE (reported then); its end releases none and reports nothing more."""
    p, _, _, _ = pair()
    params = lease(p)
    with p.lock:
        assert p.table.acquire(p.engine_id, params["lease_id"], "d", "a1", time.monotonic(),
                               first_block=3).ok
    assert p.take_released() == {"p-req"}
    with p.lock:
        assert p.table.release(p.engine_id, params["lease_id"], "d", "a1", True,
                               time.monotonic()).ok
        assert not p.table.leases
    assert p.take_released() == set()


# -- tensor parallelism: a relay and a lease per rank (docs/vllm.md) ---------------------

def test_rank_entries_give_each_ranks_lease_and_refuse_bad_shapes() -> None:
    from kvrelay.vllm.decode import MAX_RANKS, rank_entries

    base = {"lease_id": "L0", "relay": "h:1", "engine_id": "E0", "compat": "c0",
            "block_ids": [1], "num_tokens": 3, "first_token": 7}
    assert rank_entries(base) == [base]
    ranks = [{"lease_id": f"L{i}", "relay": f"h:{i + 1}", "engine_id": f"E{i}",
              "compat": f"c{i}"} for i in range(2)]
    got = rank_entries({**base, "ranks": ranks})
    assert [g["lease_id"] for g in got] == ["L0", "L1"] and got[1]["relay"] == "h:2"
    assert all("ranks" not in g and g["block_ids"] == [1] for g in got)
    for bad, why in ((5, "ranks must be a list"), ([], "ranks must be a list"),
                     ([ranks[0]] * (MAX_RANKS + 1), "ranks must be a list"),
                     (["x"], "ranks must be a list"),
                     ([{**ranks[0], "block_ids": [9]}], "exactly the fields"),
                     ([{"lease_id": "L0"}], "exactly the fields")):
        with pytest.raises(ValueError, match=why):
            rank_entries({**base, "ranks": bad})


def name_rank_leases(ps: list[PrefillSide]) -> tuple[list[HoldSpec], dict[str, Any]]:
    """What P's scheduler does at TP: one lease per worker of ``ps`` for request "req",
    every worker's hold, and params with rank 0's lease on top and each rank's in
    ``ranks``."""
    holds, entries = [], []
    for p in ps:
        hold, params = name_lease(p, "req")
        holds.append(hold)
        entries.append({k: params[k] for k in RANK_FIELDS})
    return holds, dict(params, **entries[0], ranks=entries)


def load_on_each(ds: list[DecodeSide], params: dict[str, Any], blocks: list[int]) -> None:
    """Every worker of ``ds`` loads request "req" into ``blocks``; each reports it once,
    committed."""
    for d in ds:
        d.start([LoadSpec("req", params, PROMPT, blocks, 0)], [])
    for d in ds:
        got: dict[str, bool] = {}
        wait_for(finished(d, got), "D's load")
        assert got == {"req": False}


def test_each_rank_makes_only_its_own_leases_and_d_ranks_pull_their_own() -> None:
    """Two P workers (ranks) and two D workers in one process, each rank's cache holding
    other values: the scheduler's holds go to every P worker, each makes its own lease;
    each D worker pulls its rank's lease into its own cache; each lease ends once."""
    settings = ConnectorSettings(lease_timeout=10.0)
    p_caches = [vllm_like_cache(True) for _ in range(2)]
    d_caches = [vllm_like_cache(False) for _ in range(2)]
    ps = [PrefillSide(settings, layer_cache(c), f"c{r}", f"P{r}") for r, c in
          enumerate(p_caches)]
    ds = [DecodeSide(settings, layer_cache(c), f"c{r}", f"D{r}", rank=r, workers=2)
          for r, c in enumerate(d_caches)]
    try:
        holds, params = name_rank_leases(ps)
        for p in ps:
            p.hold_all(holds)  # vLLM hands every worker the step's metadata
        assert [len(p.table.leases) for p in ps] == [1, 1]
        blocks = [7, 8, 9]
        load_on_each(ds, params, blocks)
        for r in range(2):
            for layer, src in p_caches[r].items():
                assert torch.equal(d_caches[r][layer][blocks], src[[5, 2, 3]])
        released = [p.take_released() for p in ps]
        assert released == [{"req"}, {"req"}]  # one report per worker, from each
    finally:
        for side in (*ps, *ds):
            side.close()


def test_a_given_back_lease_of_each_rank_is_aborted_once() -> None:
    """D at TP 2 refused params naming 2 ranks: worker r aborts P's lease r only."""
    settings = ConnectorSettings(lease_timeout=30.0)
    ps = [PrefillSide(settings, layer_cache(vllm_like_cache(True)), "c", f"P{r}")
          for r in range(2)]
    ds = [DecodeSide(settings, layer_cache(vllm_like_cache(False)), "c", f"D{r}", rank=r,
                     workers=2) for r in range(2)]
    try:
        holds, params = name_rank_leases(ps)
        entries = params["ranks"]
        for p in ps:
            p.hold_all(holds)
        for d in ds:
            d.start([], [], [params])
        for p, e in zip(ps, entries, strict=True):
            wait_for(lambda p=p: p.take_released() == {"req"}, "the give-back", timeout=10)
            assert p.table.release_reason(e["lease_id"]).value == "aborted"
        # Each D worker sent its rank's ABORT only: it dialled that rank's relay alone.
        assert [list(d.client._peers) for d in ds] == [[e["relay"]] for e in entries]
    finally:
        for side in (*ps, *ds):
            side.close()


def test_one_decode_worker_pulls_two_prefill_ranks_into_its_head_halves() -> None:
    """Heterogeneous TP: P at TP 2 (2 heads a rank), D at TP 1 (4 heads). D's worker has
    a side per P rank over its head slice, named as that rank's cache; each pulls its
    rank's lease; vLLM hears of the load once, after both, and each lease ends once. A
    load one rank fails is reported once, failed."""
    settings = ConnectorSettings(lease_timeout=10.0)
    p_caches = [vllm_like_cache(True) for _ in range(2)]
    storage = torch.zeros(LAYERS, BLOCKS, 2 * HEADS, BS, 2 * HEAD)
    d_cache = {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(LAYERS)}
    whole = layer_cache(d_cache)
    ps = [PrefillSide(settings, layer_cache(c), f"c{r}", f"P{r}") for r, c in
          enumerate(p_caches)]
    parts = [named_as(head_part(whole, r, 2), whole)
             for r in range(2)]
    assert [part.layout.name for part in parts] == [layer_cache(c).layout.name
                                                    for c in p_caches]
    mapped = MappedDecode([DecodeSide(settings, part, f"c{r}", "D", rank=r, workers=2)
                           for r, part in enumerate(parts)])
    try:
        holds, params = name_rank_leases(ps)
        for p in ps:
            p.hold_all(holds)
        blocks = [7, 8, 9]
        mapped.sides[1].transport.delay = 0.3  # rank 1's pull ends last
        mapped.start([LoadSpec("req", params, PROMPT, blocks, 0)], [])
        wait_for(lambda: mapped.sides[0].loads.finished == {"req"}, "rank 0's pull")
        assert mapped.take_finished() == (set(), set())  # rank 1 still copies
        reports: list[tuple[set[str], set[str]]] = []
        wait_for(lambda: bool(reports.append(mapped.take_finished()) or reports[-1][0]),
                 "both pulls")
        assert reports[-1] == ({"req"}, set()) and mapped.take_finished() == (set(), set())
        for r in range(2):
            for layer, src in p_caches[r].items():
                got = d_cache[layer][blocks][:, r * HEADS:(r + 1) * HEADS]
                assert torch.equal(got, src[[5, 2, 3]])
        assert [p.take_released() for p in ps] == [{"req"}, {"req"}]
        assert all(p.table.release_reason(e["lease_id"]).value == "done"
                   for p, e in zip(ps, params["ranks"], strict=True))
        # rank 1's lease already gone: that pull fails, rank 0's commits; one report
        holds, params = name_rank_leases(ps)
        for p in ps:
            p.hold_all(holds)
        ps[1].table.abort("P1", params["ranks"][1]["lease_id"], time.monotonic())
        mapped.start([LoadSpec("req2", params, PROMPT, blocks, 0)], [])
        reports = []
        wait_for(lambda: bool(reports.append(mapped.take_finished()) or reports[-1][0]),
                 "the failed load")
        assert reports[-1] == ({"req2"}, {"req2"})
    finally:
        for side in (*ps, mapped):
            side.close()


def test_two_decode_workers_pull_the_parts_of_one_prefill_workers_lease() -> None:
    """Heterogeneous TP the other way: P at TP 1 (4 heads), D at TP 2 (2 heads a worker).
    Each D worker HELLOs with P's layout name (layout.widened) and pulls part r of 2 of
    P's one lease: the first ACQUIRE splits it, P serves each part its head slice, and
    P's request is reported once, after both parts ended."""
    settings = ConnectorSettings(lease_timeout=10.0)
    storage = torch.randn(LAYERS, BLOCKS, 2 * HEADS, BS, 2 * HEAD)
    p_cache = {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(LAYERS)}
    d_caches = [vllm_like_cache(False) for _ in range(2)]
    p = PrefillSide(settings, layer_cache(p_cache), "c0", "P0")
    wides = [widened(layer_cache(c), 2).name for c in d_caches]
    assert wides == [layer_cache(p_cache).layout.name] * 2
    ds = [DecodeSide(settings, layer_cache(c), "c0", f"D{r}", rank=0, workers=1,
                     part=(r, 2), layout=wides[r]) for r, c in enumerate(d_caches)]
    try:
        hold, params = name_lease(p, "req")
        p.hold_all([hold])
        blocks = [7, 8, 9]
        ds[1].transport.delay = 0.3  # part 1's pull ends last
        load_on_each(ds, params, blocks)
        for r in range(2):
            for layer, src in p_cache.items():
                want = src[[5, 2, 3]][:, r * HEADS:(r + 1) * HEADS]
                assert torch.equal(d_caches[r][layer][blocks], want)
        released: set[str] = set()
        wait_for(lambda: bool(released.update(p.take_released()) or released), "P's report")
        assert released == {"req"} and p.take_released() == set()
        lid = params["lease_id"]
        assert p.table.release_reason(lid).value == "split"
        assert [p.table.release_reason(f"{lid}/{r}/2").value for r in range(2)] == ["done"] * 2
    finally:
        for side in (p, *ds):
            side.close()


def test_a_prefill_engine_is_pulled_from_at_the_same_size_a_multiple_or_a_divisor() -> None:
    assert p_ranks_refused(2, 2, 4) == "" and p_ranks_refused(4, 2, 2) == ""
    assert p_ranks_refused(2, 1, 4) == "" and p_ranks_refused(1, 2, 2) == ""
    assert p_ranks_refused(2, 4, 2) == ""
    for p_workers, workers, heads, transport, why in (
            (3, 2, 2, "tcp", "a multiple of this engine's workers"),
            (4, 1, 2, "tcp", "splitting its heads evenly"),
            (2, 3, 2, "tcp", "a divisor of its workers"),
            (1, 2, 1, "tcp", "with one head a worker"),
            (1, 2, 2, "nixl", "over tcp only, this engine's kv_transport is nixl")):
        got = p_ranks_refused(p_workers, workers, heads, transport)
        assert f"from {p_workers} tensor-parallel workers, this engine has {workers} " \
            f"workers of {heads} KV heads each: " in got and why in got, got


def test_only_a_prefill_size_the_scheduler_accepts_gets_sides_of_its_own() -> None:
    """The worker routes a load or give-back by the number of P ranks its params name
    (``mapped_size``). Sizes the scheduler refuses (params a client wrote, given back)
    go to the worker's own side, which aborts P's leases whole: no side is built."""
    entry = dict.fromkeys(RANK_FIELDS, "")
    got = {n: mapped_size({"ranks": [entry] * n}, 2, 2, "tcp") for n in (1, 2, 3, 4, 5, 64)}
    assert got == {1: 1, 2: None, 3: None, 4: 4, 5: None, 64: None}
    assert mapped_size({"ranks": "junk"}, 2, 2, "tcp") is None
    assert mapped_size({"lease_id": "L"}, 1, 2, "tcp") is None  # one P worker, one ours
    assert mapped_size({"ranks": [entry]}, 2, 1, "tcp") is None  # one head a worker
    assert mapped_size({"ranks": [entry]}, 2, 2, "nixl") is None
    assert mapped_size({"ranks": [entry] * 4}, 2, 2, "nixl") == 4


def test_relay_port_is_offset_by_worker_and_the_advertised_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = ConnectorSettings(relay_port=7100, relay_host="0.0.0.0", relay_advertise_host="10.1.2.3")
    assert s.sides(3, serve=True).relay_port == 7103
    assert s.sides(3, serve=True).relay_advertise_host == "10.1.2.3"
    assert s.sides(3).relay_port == 7100  # D binds nothing
    assert ConnectorSettings().sides(5, serve=True).relay_port == 0  # any port, per worker
    with pytest.raises(ValueError, match="past 65535"):
        ConnectorSettings(relay_port=65535).sides(1, serve=True)
    wild = ConnectorSettings(relay_host="0.0.0.0")
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    with pytest.raises(ValueError, match="relay_advertise_host"):
        wild.sides(0, serve=True)
    monkeypatch.setenv("VLLM_HOST_IP", "10.9.9.9")
    assert wild.advertised_host() == "10.9.9.9"
    assert ConnectorSettings(relay_host="10.0.0.5").advertised_host() == "10.0.0.5"
    # spelled as D spells the address it dials (the HELLO proof is bound to it)
    assert ConnectorSettings(relay_advertise_host="P-1.Example.").advertised_host() == \
        "p-1.example"
    assert ConnectorSettings(relay_advertise_host="[fd00::02]").advertised_host() == "fd00::2"
    with pytest.raises(ValueError, match="relay_advertise_host 'a b'"):
        ConnectorSettings(relay_advertise_host="a b").advertised_host()


def test_a_relay_bound_to_every_address_advertises_the_one_given() -> None:
    """relay_host 0.0.0.0: P's params name relay_advertise_host, and a D pulls there."""
    settings = ConnectorSettings(relay_host="0.0.0.0", relay_advertise_host="127.0.0.1")
    p_cache, d_cache = vllm_like_cache(True), vllm_like_cache(False)
    p = PrefillSide(settings, layer_cache(p_cache), "c0", "P1")
    d = DecodeSide(ConnectorSettings(), layer_cache(d_cache), "c0", "D1")
    try:
        assert p.server.address.startswith("127.0.0.1:")
        params = lease(p)
        d.start([LoadSpec("r", params, PROMPT, [1, 2, 3], 0)], [])
        got: dict[str, bool] = {}
        wait_for(finished(d, got), "D's load")
        assert got == {"r": False}
    finally:
        p.close()
        d.close()
