"""The prefill relay answers decode engines while the model forward runs (issue 9.3).

The engine loop used to hold the relay's lock through ``runner.execute``, so a
HEARTBEAT waited for the whole step. Here the step is held open by a gate; the
answer must arrive while the runner is still inside that same step."""

from __future__ import annotations

import threading

from kvrelay.bench.relay_rig import SleepingRunner, keep_busy, prefill_engine, time_answers


def test_relay_answers_while_the_step_is_still_running() -> None:
    gate = threading.Event()
    runner = SleepingRunner(step_s=20.0, gate=gate)
    with prefill_engine(runner) as (loop, server):
        keep_busy(loop, 2)
        assert runner.in_step.wait(10)
        try:
            times = time_answers(server.address, messages=5, interval_s=0.0)
            assert runner.steps_done == 0, "the relay answered only after the step ended"
            assert len(times) == 5
        finally:
            gate.set()
