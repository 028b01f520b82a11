import subprocess
import sys

import pytest

from kvrelay.core.engine import Engine
from kvrelay.core.lifecycle import RequestState
from kvrelay.core.request import Request
from kvrelay.sim.engine_sim import run_seed


def test_same_seed_same_trace() -> None:
    for seed in (3, 17, 1234):
        a, b = run_seed(seed), run_seed(seed)
        assert a.trace == b.trace and a.trace_digest == b.trace_digest
    assert run_seed(3).trace != run_seed(4).trace


def test_two_thousand_seeds_without_a_violation() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrelay.sim", "engine", "--seeds", "2000"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2000 seeds, 0 violations" in proc.stdout.splitlines()[-1]


def test_a_broken_fence_is_caught_with_a_replay_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """The naive design frees at once on abort/finish, even with a step in flight."""
    original = Engine._release_if_fenced

    def release_ignoring_fence(self: Engine, req: Request) -> None:
        if req.state is RequestState.FINISHING:
            req.in_flight = 0
        original(self, req)

    monkeypatch.setattr(Engine, "_release_if_fenced", release_ignoring_fence)
    violations = [v for s in range(200) if (v := run_seed(s).violation) is not None]
    assert violations, "the simulator should catch compute on freed blocks"
    # Seeds whose device lags may fail on its tail first; the others on the step itself.
    assert any("while the step is in flight" in v or "KvCorruption" in v for v in violations)


def test_a_release_before_the_device_is_done_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The naive design frees when a step's output is applied, even when the device (a
    GPU after a step where no row samples) may still write the blocks."""
    monkeypatch.setattr(Engine, "_lands_now", lambda self, batch: True)
    failing = [s for s in range(60) if run_seed(s).violation is not None]
    assert failing, "the simulator should catch blocks reused while the device writes them"
    assert "while the device still writes it" in (run_seed(failing[0]).violation or "")


def test_replay_prints_the_trace() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrelay.sim", "engine", "--seed", "5", "--trace"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[0].startswith("0.0000 config")
    assert proc.stdout.splitlines()[-1].startswith("1 seeds, 0 violations")
