"""The engine loop thread: hand-over, rejection, abort, shutdown and runner failure."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping

import httpx
import pytest

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine, RequestOutput, RequestRejected
from kvrelay.core.lifecycle import FinishReason, RequestState
from kvrelay.core.runner import Batch, SampledToken
from kvrelay.sampling_params import SamplingParams
from kvrelay.server.engine_loop import AdmissionFailed, EngineDead, EngineLoop
from kvrelay.testing.fake_runner import FakeRunner, expected_output
from kvrelay.wire.http import param_from_loc
from tests.unit.server.fakes import make_state, serve_in_thread


def make_loop(async_scheduling: bool = False, runner: object | None = None) -> EngineLoop:
    config = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64,
                             async_scheduling=async_scheduling)
    return EngineLoop(Engine(config, runner or FakeRunner(100)), idle_poll_s=0.05)  # type: ignore[arg-type]


async def drain(q: asyncio.Queue[RequestOutput]) -> list[RequestOutput]:
    outs = []
    while not outs or not outs[-1].finished:
        outs.append(await asyncio.wait_for(q.get(), 5))
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_outputs_reach_the_request_queue(async_scheduling: bool) -> None:
    async def main() -> None:
        loop = make_loop(async_scheduling)
        loop.start(asyncio.get_running_loop())
        queues = [asyncio.Queue[RequestOutput]() for _ in range(4)]
        for i, q in enumerate(queues):
            await loop.add(f"r{i}", [1] * (i + 1), SamplingParams(max_tokens=5, seed=i), q)
        for i, q in enumerate(queues):
            outs = await drain(q)
            tokens = [t for o in outs for t in o.new_token_ids]
            assert tokens == expected_output(i, i + 1, 5, 100)
            assert outs[-1].finish_reason is FinishReason.LENGTH
        await asyncio.to_thread(loop.stop)
        assert loop.engine.pool.num_free == 32

    asyncio.run(main())


def test_rejection_is_raised_to_the_caller() -> None:
    async def main() -> None:
        loop = make_loop()
        loop.start(asyncio.get_running_loop())
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with pytest.raises(RequestRejected) as info:
            await loop.add("r", [1] * 70, SamplingParams(max_tokens=1), q)
        assert info.value.param == "prompt"
        await asyncio.to_thread(loop.stop)
        with pytest.raises(EngineDead):
            await loop.add("r2", [1], SamplingParams(max_tokens=1), q)

    asyncio.run(main())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_and_stop_release_every_block(async_scheduling: bool) -> None:
    async def main() -> None:
        loop = make_loop(async_scheduling)
        loop.start(asyncio.get_running_loop())
        q1: asyncio.Queue[RequestOutput] = asyncio.Queue()
        q2: asyncio.Queue[RequestOutput] = asyncio.Queue()
        await loop.add("a", [1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True), q1)
        await loop.add("b", [1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True), q2)
        await asyncio.wait_for(q1.get(), 5)
        loop.abort("a")
        loop.abort("a")  # a second abort is a no-op, never a second free
        outs = await drain(q1)
        assert outs[-1].finish_reason in (FinishReason.ABORT, FinishReason.LENGTH)
        await asyncio.to_thread(loop.stop)  # aborts b, lets in-flight steps drain
        last = (await drain(q2))[-1]
        assert last.finished
        engine = loop.engine
        assert engine.pool.num_free == 32 and not engine.requests
        engine.pool.check_integrity()

    asyncio.run(main())


class ExplodingRunner:
    """Raises on the 3rd call only (a transient fault), and on every step that holds a
    poisoned token (a request the model cannot run)."""

    POISON = 99

    def __init__(self) -> None:
        self.calls = 0

    def execute(self, batch: Batch) -> Mapping[str, SampledToken]:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("device lost")
        if any(self.POISON in sr.token_ids for sr in batch.requests):
            raise IndexError("index out of range in self")
        return {sr.request_id: SampledToken(7) for sr in batch.requests if sr.sample}


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on() -> None:
    async def main() -> None:
        loop = make_loop(runner=ExplodingRunner())
        loop.start(asyncio.get_running_loop())
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        await loop.add("r", [1], SamplingParams(max_tokens=20), q)
        last = (await drain(q))[-1]
        assert last.finish_reason is FinishReason.ERROR and "device lost" in (last.error or "")
        await loop.add("bad", [1, ExplodingRunner.POISON], SamplingParams(max_tokens=4), q)
        last = (await drain(q))[-1]
        assert last.finish_reason is FinishReason.ERROR and "IndexError" in (last.error or "")
        await loop.add("good", [1, 2], SamplingParams(max_tokens=3), q)
        outs = await drain(q)
        assert [t for o in outs for t in o.new_token_ids] == [7, 7, 7]
        assert outs[-1].finish_reason is FinishReason.LENGTH
        assert loop.alive and loop.engine.stats.failed_steps == 2
        await asyncio.sleep(0.05)
        assert loop.engine.pool.num_free == loop.engine.pool.num_blocks
        loop.engine.pool.check_integrity()
        loop.stop()

    asyncio.run(main())


def test_an_exception_while_admitting_fails_that_request_only() -> None:
    async def main() -> None:
        loop = make_loop()
        real_add = loop.hooks.add

        def add(engine: Engine, cmd: object) -> None:
            real_add(engine, cmd)  # type: ignore[arg-type]
            if cmd.request_id == "bad":  # type: ignore[attr-defined]
                raise KeyError("a bug while admitting")

        loop.hooks.add = add  # type: ignore[method-assign]
        loop.start(asyncio.get_running_loop())
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with pytest.raises(AdmissionFailed, match="KeyError"):
            await loop.add("bad", [1], SamplingParams(max_tokens=4), q)
        await loop.add("good", [1], SamplingParams(max_tokens=2), q)
        assert (await drain(q))[-1].finish_reason is FinishReason.LENGTH
        await asyncio.sleep(0.05)
        assert loop.alive and loop.engine.pool.num_free == loop.engine.pool.num_blocks
        assert not loop.engine.requests
        loop.stop()

    asyncio.run(main())


def test_runner_failure_over_http_is_500_and_the_server_keeps_serving() -> None:
    state = make_state()
    state.loop.engine.runner = ExplodingRunner()
    with serve_in_thread(state) as url:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 20}
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20


def test_param_from_loc() -> None:
    assert param_from_loc(("messages", 0, "content", "str")) == "messages[0].content"
    assert param_from_loc(("prompt", "list[int]", 0)) == "prompt"
    assert param_from_loc(("temperature",)) == "temperature"
    assert param_from_loc(()) == "body"


def test_drain_ends_streams_with_abort_and_refuses_new_requests() -> None:
    state = make_state(delay_s=0.01)
    with serve_in_thread(state) as url:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data"))
            next(lines)
            state.loop.drain()
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"abort"' in rest[-2]
        r2 = httpx.post(url + "/v1/completions", json={**body, "stream": False})
        assert r2.status_code == 503
        assert state.loop.engine.pool.num_free == state.loop.engine.pool.num_blocks


class ThreadDeviceWork:
    """A completion token that a test thread ends; says when the loop blocked on it."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.waited = threading.Event()

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self) -> None:
        self.waited.set()
        assert self.finished.wait(10), "the test never ended the device work"


class LaggingDeviceRunner(FakeRunner):
    """Every step's device work ends only when the test ends ``work``."""

    def __init__(self) -> None:
        super().__init__(100)
        self.work = ThreadDeviceWork()

    def execute(self, batch: Batch) -> dict[str, SampledToken]:
        out = super().execute(batch)
        batch.completion = self.work
        return out


def test_the_loop_holds_blocks_until_the_device_is_done_and_waits_without_spinning() -> None:
    async def main() -> None:
        runner = LaggingDeviceRunner()
        loop = make_loop(runner=runner)
        loop.start(asyncio.get_running_loop())
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        await loop.add("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2, seed=1), q)
        outs = await drain(q)  # the client has its answer at once
        assert [t for o in outs for t in o.new_token_ids] == expected_output(1, 5, 2, 100)
        # Nothing left to run: the loop blocks on the token (outside the relay's lock),
        # and while it does, the request's blocks are still its own.
        assert await asyncio.to_thread(runner.work.waited.wait, 10)
        engine = loop.engine
        assert engine.requests["r"].state is RequestState.FINISHING
        assert engine.pool.num_free == 32 - 2
        runner.work.finished.set()
        await asyncio.to_thread(loop.stop)
        assert engine.pool.num_free == 32 and not engine.requests
        engine.pool.check_integrity()

    asyncio.run(main())
