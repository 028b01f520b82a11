"""The drain of ``kvrelay serve`` on SIGTERM (kvrelay.wire.drain, graceful).

The gate itself in process (ASGI, a stand-in inner app); then a real ``kvrelay serve``
process on the unit tests' stand-in model parts (as tests/unit/server/test_server_cli.py):
SIGTERM with a stream in flight, /health draining at once, new work refused with 503
and Retry-After, other routes served, the stream finishing, exit 0. The prefill
engine's wait for its leases is shown on real engines in tests/e2e/test_drain.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.server.api import create_app
from kvrelay.wire.drain import DrainGate, DrainState
from tests.unit.server.fakes import free_port, make_state, stream_in_flight, wait_serving

REPO = Path(__file__).resolve().parents[3]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_gate_refuses_new_generations_while_draining_and_counts_the_rest() -> None:
    entered, release = asyncio.Event(), asyncio.Event()
    seen: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["path"])
        if scope["path"] == "/v1/kv/release":
            entered.set()
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    now = [100.0]
    state = DrainState(grace_s=7.5, clock=lambda: now[0])
    gate = DrainGate(inner, state)

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=gate)
        async with httpx.AsyncClient(transport=transport, base_url="http://e") as c:
            assert (await c.post("/v1/completions", json={})).status_code == 200
            held = asyncio.ensure_future(c.post("/v1/kv/release", json={}))
            await entered.wait()
            assert state.in_flight == 1
            assert state.begin() and not state.begin()  # the second signal starts nothing
            now[0] += 2.0
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = await c.post(path, json={})
                assert r.status_code == 503, path
                assert r.headers["retry-after"] == "6"  # ceil(7.5 - 2.0)
                assert r.json()["error"]["code"] == "draining"
                assert r.json()["error"]["type"] == "server_error"
            # Served while draining: the release of a lease, the model list, /health
            # (the app answers it: draining, see below).
            assert (await c.get("/v1/models")).status_code == 200
            assert (await c.get("/health")).status_code == 200
            release.set()
            assert (await held).status_code == 200
            assert state.in_flight == 0

    _run(scenario())
    assert seen == ["/v1/completions", "/v1/kv/release", "/v1/models", "/health"]
    now[0] += 60
    assert state.headers() == {"Retry-After": "1"}  # never 0, also past the grace period


def test_health_says_draining_with_retry_after() -> None:
    state = make_state()
    state.drain = DrainState(grace_s=30)
    app = create_app(state)

    async def health() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://e") as c:
            return await c.get("/health")

    state.drain.begin()
    r = _run(health())
    assert r.status_code == 503
    assert 1 <= int(r.headers["retry-after"]) <= 30
    assert r.json()["status"] == "draining" and r.json()["error"]["code"] == "draining"


CHILD = """
import os, sys, time
import kvrelay.server.cli as serve_cli
from tests.unit.server.fakes import make_state

def build(args):
    state = make_state(num_blocks=256, max_model_len=256, delay_s=0.01)
    runner = state.loop.engine.runner
    execute, steps = runner.execute, [0]

    def held(batch):
        # After a few tokens the stand-in model waits while the test's hold file exists,
        # so the stream is still running for every check the test makes.
        steps[0] += 1
        while steps[0] > 3 and os.path.exists(sys.argv[2]):
            time.sleep(0.01)
        return execute(batch)

    runner.execute = held
    return state

serve_cli.build_state = build
from kvrelay.cli import main
sys.exit(main(["serve", "--port", sys.argv[1], "--shutdown-timeout", "60",
               "--log-level", "info"]))
"""


@pytest.mark.e2e
def test_sigterm_drains_a_stream_refuses_new_work_and_exits_zero(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log, hold = tmp_path / "serve.log", tmp_path / "hold"
    hold.touch()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(port), str(hold)],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(url, proc, log)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 20, "stream": True}
        lines, t = stream_in_flight(url, body, timeout=60)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (r := httpx.get(url + "/health", timeout=30)).status_code == 200:
            assert time.monotonic() < deadline, "/health never said draining"
            time.sleep(0.01)
        assert r.status_code == 503 and r.json()["status"] == "draining"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        refused = httpx.post(url + "/v1/completions", timeout=30,
                             json={"model": "tiny", "prompt": "y", "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "draining" and "retry-after" in refused.headers
        assert httpx.get(url + "/v1/models", timeout=30).status_code == 200
        assert proc.poll() is None and not lines[-1].endswith("[DONE]")  # still streaming
        hold.unlink()  # the stream may finish now, and then the drain
        assert proc.wait(60) == 0
        t.join(10)
        assert lines[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in lines[-2]  # finished, not aborted
        text = log.read_text()
        assert "draining for at most 60.0 s" in text and "drained in" in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
