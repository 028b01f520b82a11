"""A decode engine that closes the proxy's connection before answering a streamed leg.

The flake of tests/e2e/test_drain.py (a client's stream ended "the decode engine URL
failed mid-stream: ReadError: "): a draining engine, its drain done, shuts down and
closes its idle keep-alive connections; the proxy had just sent a leg on one of them,
from its pool. uvicorn closes only a connection with no request in hand (one it has
read gets its answer: 503 while draining), so the leg was never read, the lease never
touched. The proxy must hand it to the next decode engine as it does a refused
connection or a 503, not end the client's stream with an error.

Here the engines are bare HTTP/1.1 servers on real sockets: a prefill engine that
answers token 1 and a lease, a decode engine that answers the proxy's health check
(the proxy keeps that connection) and then closes the connection under the leg sent on
it, reset (its request unread: the ReadError) or closed (read: "Server disconnected
without sending a response"), and a decode engine that streams the rest. A decode
engine that fails after its status line keeps the leg: the lease is its own by then.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.unit.proxy.stubs import LEASE, REFUSED, Engine, asked


async def _streamed(p: Engine, d1: Engine, d2: Engine) -> list[Any]:
    r = await asked(p, d1, d2)
    assert r.status_code == 200, r.text
    return [json.loads(line[5:]) for line in r.text.splitlines()
            if line.startswith("data:") and line != "data: [DONE]"]


@pytest.mark.parametrize("close", ["reset", "close"])
def test_a_leg_closed_before_its_answer_goes_to_the_next_decode_engine(close: str) -> None:
    p, d1, d2 = Engine("prefill"), Engine(close), Engine("stream")
    events = asyncio.run(_streamed(p, d1, d2))
    assert not [e for e in events if "error" in e], events
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == " a b c" and events[-1]["usage"]["completion_tokens"] == 3, events
    # D1 had the leg on the connection its health check had used, and closed it.
    assert [(path, n) for path, _, n in d1.posts] == [("/v1/completions", 2)]
    # D2 got the lease as P made it; it is D2's now: P is not asked to release it.
    [(path, body, _)] = d2.posts
    assert path == "/v1/completions"
    assert body["kv_transfer_params"] == {**LEASE, "first_token_sent": True}
    assert [path for path, _, _ in p.posts] == ["/v1/completions"]


def test_a_leg_whose_engine_fails_after_its_status_line_is_not_handed_on() -> None:
    """After D's 200 the lease is D's (it may be pulling it): the stream ends with an
    error event and no other decode engine is asked."""
    p, d1, d2 = Engine("prefill"), Engine("fail_after_status"), Engine("stream")
    events = asyncio.run(_streamed(p, d1, d2))
    assert "failed mid-stream" in events[-1]["error"]["message"], events
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == " a b"
    assert len(d1.posts) == 1 and d2.posts == []


def test_a_whole_answer_whose_engine_fails_after_its_status_line_is_not_handed_on() -> None:
    """Whole answers follow the streamed rule: after D's status line the lease is D's,
    so an engine that fails mid-body is the client's 502, never another engine's try
    (whole answers used to hand such a leg on like one closed before answering)."""
    p, d1, d2 = Engine("prefill"), Engine("fail_after_status"), Engine("stream")
    r = asyncio.run(asked(p, d1, d2, stream=False))
    assert r.status_code == 502, r.text
    assert "failed" in r.json()["error"]["message"] and d1.posts and d2.posts == []
    assert [path for path, _, _ in p.posts] == ["/v1/completions"]  # D1's lease now


@pytest.mark.parametrize("close", ["reset", "close"])
def test_a_whole_answer_closed_before_it_goes_to_the_next_decode_engine(close: str) -> None:
    """Not streamed: the same close (a drained engine's, its leg unread) hands the leg on;
    the client gets D2's answer, not a 502."""
    p, d1, d2 = Engine("prefill"), Engine(close), Engine("stream")
    r = asyncio.run(asked(p, d1, d2, stream=False))
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["text"] == " a b c" and r.json()["usage"]["completion_tokens"] == 3
    assert [(path, n) for path, _, n in d1.posts] == [("/v1/completions", 2)]
    [(path, body, _)] = d2.posts
    assert path == "/v1/completions" and not body.get("stream")
    assert body["kv_transfer_params"] == {**LEASE, "first_token_sent": True}
    assert [path for path, _, _ in p.posts] == ["/v1/completions"]  # D2's lease: no release


@pytest.mark.parametrize("stream", [True, False])
def test_a_lease_lost_with_a_closed_engine_is_a_502_not_the_clients_error(stream: bool) -> None:
    """D1 read the leg and closed without answering (it died mid-decode, say): its
    attempt holds or consumed the lease, so D2's ACQUIRE is refused and D2 answers 400
    on kv_transfer_params. The client did nothing wrong: it gets a 502 (an error event
    when streamed) that names D1's close and D2's refusal."""
    p, d1, d2 = Engine("prefill"), Engine("close"), Engine("refuse_lease")
    r = asyncio.run(asked(p, d1, d2, stream=stream))
    if stream:
        assert r.status_code == 200, r.text
        events = [json.loads(line[5:]) for line in r.text.splitlines()
                  if line.startswith("data:") and line != "data: [DONE]"]
        error = events[-1]["error"]
    else:
        assert r.status_code == 502, r.text
        error = r.json()["error"]
    assert error["type"] == "server_error", error
    assert "closed the connection before answering" in error["message"], error
    assert "lease already consumed" in error["message"], error
    assert len(d1.posts) == 1 and len(d2.posts) == 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_lease_refused_without_a_close_stays_the_clients_400(stream: bool) -> None:
    """Params the client sent that no engine lost (a replayed lease): D's 400 as it is."""
    p, d1, d2 = Engine("prefill"), Engine("refuse_lease"), Engine("stream")
    r = asyncio.run(asked(p, d1, d2, stream=stream))
    if stream:
        events = [json.loads(line[5:]) for line in r.text.splitlines()
                  if line.startswith("data:") and line != "data: [DONE]"]
        assert events[-1]["error"] == REFUSED["error"], events
    else:
        assert r.status_code == 400 and r.json() == REFUSED, r.text
    assert len(d1.posts) == 1 and d2.posts == []
