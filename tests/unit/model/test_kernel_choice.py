"""The OpenMP wait policy decision, and the kernels record that /metrics exports."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvrelay.model.kernels import choice as kernel_choice
from kvrelay.model.kernels.choice import decide_wait_policy


def test_explicit_policies_are_taken_as_given() -> None:
    active = decide_wait_policy("active", 2, 8, 3, 9.0)
    assert (active.policy, active.spins) == ("ACTIVE", None)
    passive = decide_wait_policy("passive", 64, 1, 0, 0.0)
    assert (passive.policy, passive.spins) == ("PASSIVE", kernel_choice.PASSIVE_SPINS)


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
    # Shared cores: not even the short spin of `passive` (it holds a core a partner needs).
    assert choice.spins == (None if policy == "ACTIVE" else 0)
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
        "print(os.environ['OMP_WAIT_POLICY'], os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    clean = {k: v for k, v in os.environ.items() if "OMP" not in k}
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], env=clean | env, capture_output=True, text=True,
        check=True, timeout=120,
    )
    return out.stdout.strip().splitlines()[-1]


def test_default_is_passive_and_flag_and_env_apply_before_torch() -> None:
    argv = ["bench", "core"]
    passive = f"PASSIVE {kernel_choice.PASSIVE_SPINS}"
    # PASSIVE spins briefly first (the gaps between a step's parallel regions).
    assert _policy_in_child({}, argv) == passive
    assert _policy_in_child({"GOMP_SPINCOUNT": "0"}, argv) == "PASSIVE 0"
    assert _policy_in_child(
        {"GOMP_SPINCOUNT": "0"}, ["--omp-wait-policy", "passive", *argv]) == "PASSIVE 0"
    assert _policy_in_child({}, ["--omp-wait-policy", "active", *argv]) == "ACTIVE None"
    assert _policy_in_child({"KVRELAY_OMP_WAIT_POLICY": "active"},
                            ["--omp-wait-policy", "passive", *argv]) == passive
    assert _policy_in_child({"KVRELAY_OMP_WAIT_POLICY": "active"}, argv) == "ACTIVE None"
    # An explicit OMP_WAIT_POLICY wins over both, and kvrelay adds no spin to it.
    assert _policy_in_child(
        {"OMP_WAIT_POLICY": "PASSIVE"}, ["--omp-wait-policy", "active", *argv]
    ) == "PASSIVE None"


def test_metrics_export_the_kernels_in_use() -> None:
    from kvrelay.server.metrics import ServerMetrics

    kernel_choice.record_kernels("native", "avx2", "")
    kernel_choice.record_prompt_attention("amx")
    from kvrelay.config import SchedulerConfig
    from kvrelay.core.engine import Engine
    from kvrelay.testing.fake_runner import FakeRunner

    engine = Engine(SchedulerConfig(num_blocks=4, block_size=4), FakeRunner(100))
    text = ServerMetrics(engine, "m").render().decode()
    line = next(x for x in text.splitlines() if x.startswith("kvrelay_kernels_info{"))
    assert 'backend="native"' in line and 'isa="avx2"' in line and line.endswith(" 1.0")
    assert 'prompt_attention="amx"' in line
    assert f'omp_spincount="{os.environ.get("GOMP_SPINCOUNT", "")}"' in line


_POOLS = """
import os, sys, time, torch
from kvrelay.model.kernels import choice as kc

def threads() -> int:
    # Pool workers leave after their thread is joined: count once the number holds still.
    n = -1
    while n != (n := len(os.listdir("/proc/self/task"))):
        time.sleep(0.2)
    return n

torch.set_num_threads(2)  # torch starts a helper thread of its own here
x = torch.randn(1 << 22)
def work() -> None:
    kc.set_thread_count(2)
    (x * 2).sum()  # an ATen parallel region: starts this thread's OpenMP pool

start = threads()
kc.run_in_own_thread(work)
after = threads()
work()  # the control: on the main thread, the pool stays
print(start, after, threads())
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for a worker")
def test_work_run_in_its_own_thread_leaves_no_openmp_pool_behind() -> None:
    # libgomp stops spinning in every team once its pools hold more threads than CPUs,
    # so the server loads the model on a thread that ends, not on the main thread.
    out = subprocess.run([sys.executable, "-c", _POOLS], capture_output=True, text=True,
                         check=True, timeout=120)
    start, after, on_main = map(int, out.stdout.split())
    assert after == start  # the loading thread's pool ended with it
    assert on_main == start + 1  # the same work on a thread that stays keeps a worker


def test_run_in_own_thread_returns_the_value_and_raises_the_error() -> None:
    assert kernel_choice.run_in_own_thread(lambda: 41 + 1) == 42

    def fail() -> None:
        raise FileNotFoundError("no such model: m")

    with pytest.raises(FileNotFoundError, match="no such model: m"):
        kernel_choice.run_in_own_thread(fail)


def test_the_engine_loop_thread_takes_the_thread_count_it_is_given() -> None:
    # OpenMP's thread count is per thread, and torch hands its process-wide count to a
    # new thread only lazily: the loop thread sets it before its first step.
    import asyncio

    import torch

    from kvrelay.config import SchedulerConfig
    from kvrelay.core.engine import Engine, RequestOutput
    from kvrelay.sampling_params import SamplingParams
    from kvrelay.server.engine_loop import EngineLoop
    from kvrelay.testing.fake_runner import FakeRunner

    seen: list[int] = []

    class Recording(FakeRunner):
        def execute(self, batch):  # type: ignore[no-untyped-def]
            seen.append(torch.get_num_threads())
            return super().execute(batch)

    async def main() -> None:
        config = SchedulerConfig(num_blocks=8, block_size=4, max_model_len=32)
        loop = EngineLoop(Engine(config, Recording(100)), idle_poll_s=0.05, threads=3)
        loop.start(asyncio.get_running_loop())
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        await loop.add("r", [1, 2], SamplingParams(max_tokens=2), q)
        while not (await asyncio.wait_for(q.get(), 5)).finished:
            pass
        await asyncio.to_thread(loop.stop)

    before = torch.get_num_threads()
    try:
        asyncio.run(main())
    finally:
        torch.set_num_threads(before)  # the count is also torch's process-wide setting
    assert seen and set(seen) == {3}
