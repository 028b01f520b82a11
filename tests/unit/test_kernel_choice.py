"""The OpenMP wait policy decision, and the kernels record that /metrics exports."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvrelay.model import kernel_choice
from kvrelay.model.kernel_choice import decide_wait_policy


def test_explicit_policies_are_taken_as_given() -> None:
    assert decide_wait_policy("active", 2, 8, 3, 9.0).policy == "ACTIVE"
    assert decide_wait_policy("passive", 64, 1, 0, 0.0).policy == "PASSIVE"


@pytest.mark.parametrize(
    ("cpus", "threads", "others", "load", "policy"),
    [
        (2, 2, 0, 0.1, "ACTIVE"),  # a quiet 2-core machine, both cores ours
        (2, 2, 0, 0.7, "PASSIVE"),  # something else keeps a core busy
        (2, 2, 1, 0.0, "PASSIVE"),  # another kvrelay engine on the host
        (16, 4, 2, 3.0, "ACTIVE"),  # plenty of free cores for our 4 threads
        (4, 4, 0, 2.2, "PASSIVE"),
    ],
)
def test_auto_spins_only_with_a_free_core_per_thread(
    cpus: int, threads: int, others: int, load: float, policy: str
) -> None:
    choice = decide_wait_policy("auto", cpus, threads, others, load)
    assert choice.policy == policy
    assert choice.requested == "auto" and f"{threads} threads" in choice.reason


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="active, passive, auto"):
        decide_wait_policy("spin", 2, 2, 0, 0.0)


def _policy_in_child(env: dict[str, str], argv: list[str]) -> str:
    """What a fresh interpreter ends up with: the policy must be set before torch loads."""
    code = (
        "import sys, kvrelay.cli as c\n"
        "a = c.build_parser().parse_args(sys.argv[1:])\n"
        "c._apply_process_settings(a)\n"
        "import os, torch\n"
        "print(os.environ['OMP_WAIT_POLICY'])\n"
    )
    clean = {k: v for k, v in os.environ.items() if "OMP" not in k}
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], env=clean | env, capture_output=True, text=True,
        check=True, timeout=120,
    )
    return out.stdout.strip().splitlines()[-1]


def test_default_is_passive_and_flag_and_env_apply_before_torch() -> None:
    argv = ["bench", "core"]
    assert _policy_in_child({}, argv) == "PASSIVE"
    assert _policy_in_child({}, ["--omp-wait-policy", "active", *argv]) == "ACTIVE"
    assert _policy_in_child({"KVRELAY_OMP_WAIT_POLICY": "active"}, argv) == "ACTIVE"
    # An explicit OMP_WAIT_POLICY wins over both.
    assert _policy_in_child(
        {"OMP_WAIT_POLICY": "PASSIVE"}, ["--omp-wait-policy", "active", *argv]) == "PASSIVE"


def test_metrics_export_the_kernels_in_use() -> None:
    from kvrelay.server.metrics import ServerMetrics

    kernel_choice.record_kernels("native", "avx2", "")
    from kvrelay.config import SchedulerConfig
    from kvrelay.core.engine import Engine
    from kvrelay.core.fake_runner import FakeRunner

    engine = Engine(SchedulerConfig(num_blocks=4, block_size=4), FakeRunner(100))
    text = ServerMetrics(engine, "m").render().decode()
    line = next(x for x in text.splitlines() if x.startswith("kvrelay_kernels_info{"))
    assert 'backend="native"' in line and 'isa="avx2"' in line and line.endswith(" 1.0")
