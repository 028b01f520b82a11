"""The pd simulation: 5,000 seeds without a violation, deterministic replays."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.relay import receiver as R
from kvrelay.sim.__main__ import main
from kvrelay.sim.pd import run_pd, run_seed

SEEDS = 5000


def test_5000_seeds_no_violation() -> None:
    lines: list[str] = []
    violations = run_pd(range(SEEDS), out=lines.append)
    assert violations == 0, "\n".join(lines[:20])
    assert lines[-1] == f"{SEEDS} seeds, 0 violations"


def test_same_seed_same_trace() -> None:
    for seed in (3, 77, 1234):
        a = run_seed(seed, trace=True)[1].trace
        b = run_seed(seed, trace=True)[1].trace
        assert a and a == b


def test_a_failing_seed_prints_its_replay_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The naive design: decode on whatever the transfer copied, without the fence.
    def no_fence(self: R.Receiver, load: R.Load, reply: object, now: float) -> None:
        if not load.aborted:
            self.engine.load_done(load.request_id, shareable=True)
        self._finish_load(load)

    monkeypatch.setattr(R.Receiver, "_on_committed", no_fence)
    lines: list[str] = []
    assert run_pd(range(700, 900), out=lines.append) > 0
    assert any("decodes on bad KV" in line for line in lines)
    replay = next(line for line in lines if "replay:" in line)
    seed = int(replay.split("--seed ")[1].split()[0])
    assert main(["pd", "--seed", str(seed)]) == 1
    assert "decodes on bad KV" in capsys.readouterr().out


def test_the_simulator_finds_the_replay_bug_without_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sim replays params to the same and another decode engine. With every attempt
    given the same nonce (the design before leases bound one attempt: holder = engine
    id only) a replay commits on KV it copied after P freed and reused the blocks."""
    orig = R.Receiver.__init__

    def one_attempt(self: R.Receiver, *a: Any, **kw: Any) -> None:
        kw["new_attempt"] = lambda: "same"
        orig(self, *a, **kw)

    monkeypatch.setattr(R.Receiver, "__init__", one_attempt)
    lines: list[str] = []
    assert run_pd(range(95, 110), out=lines.append) > 0
    assert any("r0 decodes on bad KV" in line for line in lines), lines
    monkeypatch.undo()
    assert run_pd(range(95, 110), out=lines.append) == 0


def test_the_simulator_exercises_partial_pulls() -> None:
    """Decode engines pull only what their prefix cache lacks in some seeds, and some
    aborts land while such a pull is in flight (the CI seeds cover both)."""
    cached = seeds_with = aborts = 0
    for seed in range(SEEDS // 5):
        err, w = run_seed(seed)
        assert err is None, err
        n = w.d.receiver.stats.cached_blocks + w.d2.receiver.stats.cached_blocks
        cached += n
        seeds_with += n > 0
        aborts += w.partial_pull_aborts
    assert seeds_with >= 50 and cached > seeds_with and aborts > 0, (seeds_with, aborts)


def test_the_simulator_finds_a_partial_pull_into_the_shared_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receiver that lays the pulled tail over the request's first blocks (the shared,
    cached prefix) corrupts KV that other requests decode on: the sim catches it."""
    orig = R.Receiver._on_acquired

    def misplaced(self: R.Receiver, load: R.Load, reply: Any, now: float) -> None:
        first = load.first_block
        if first:
            local = load.local_blocks
            load.local_blocks = local[first:] + local[:first]
        orig(self, load, reply, now)
        if first:
            load.local_blocks = local

    monkeypatch.setattr(R.Receiver, "_on_acquired", misplaced)
    lines: list[str] = []
    assert run_pd(range(SEEDS // 5), out=lines.append) > 0
    assert any("decodes on bad KV" in line or "writes into block" in line
               for line in lines), lines[:5]
