"""A streamed answer is one engine's sequence, never P's head on D's tail.

A decode engine that samples the first token again itself (vLLM's, behind
kvrelay.vllm: its lease says ``resends_first_token``) answers the whole choice. The
proxy used to stream P's first token at once and then cut as many characters from D's
text: where D sampled another first token (any temperature > 0 without a shared seed,
or a near-tie P and D break differently) the client got P's token followed by the rest
of D's sequence, text no engine produced. Now P's token goes out early only for greedy
requests, and is checked against D's: a mismatch ends the stream with an error event;
sampled requests stream D's whole sequence.

P, D1 and D2 are bare HTTP engines on real sockets (stubs.py); D1 streams " x b c", a
sequence whose first token differs from P's " a".
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tests.unit.proxy.stubs import FIRST, LEASE, Engine, asked

RESENDS = dict(FIRST, kv_transfer_params=dict(LEASE, resends_first_token=True))


def _chunk(text: str, finish: str | None) -> dict[str, Any]:
    return {"id": "cmpl-d", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish}], "usage": None}


USAGE = {"id": "cmpl-d", "object": "text_completion", "created": 0, "model": "m",
         "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3,
                                  "total_tokens": 5}}


def _d_sequence(first: str) -> list[dict[str, Any]]:
    """D's own stream: its first token (sampled again), then " b", " c"."""
    return [_chunk(first, None), _chunk(" b", None), _chunk(" c", "length"), USAGE]


def _events(d_first: str, sampling: dict[str, Any]) -> tuple[list[Any], Engine]:
    p, d1, d2 = Engine("prefill", first=RESENDS), Engine("stream", stream=_d_sequence(
        d_first)), Engine("stream")
    r = asyncio.run(asked(p, d1, d2, body=sampling))
    assert r.status_code == 200, r.text
    events = [json.loads(line[5:]) for line in r.text.splitlines()
              if line.startswith("data:") and line != "data: [DONE]"]
    return events, d1


def _text(events: list[Any]) -> str:
    return "".join(c["text"] for e in events if "choices" in e for c in e["choices"])


def test_a_sampled_request_streams_the_decode_engines_whole_sequence() -> None:
    """temperature 0.8: P's " a" is not streamed; the client gets D's " x b c" whole,
    its first token included, and D was not told the client has token 1."""
    events, d1 = _events(" x", {"temperature": 0.8, "seed": 3})
    assert not [e for e in events if "error" in e], events
    assert _text(events) == " x b c", events
    assert events[-1]["usage"]["completion_tokens"] == 3
    [(_, body, _)] = d1.posts
    assert "first_token_sent" not in body["kv_transfer_params"]


def test_a_greedy_request_streams_the_first_token_early_when_d_agrees() -> None:
    """temperature 0: P's " a" goes out first; D's resent " a" is cut, not doubled."""
    events, _ = _events(" a", {"temperature": 0})
    assert not [e for e in events if "error" in e], events
    assert _text(events[:1]) == " a"  # P's token, before D answered
    assert _text(events) == " a b c", events


def test_a_greedy_request_whose_first_token_d_breaks_differently_stops_unspliced() -> None:
    """temperature 0 and a near-tie D breaks the other way: after P's " a" the stream
    ends with an error event that says why; D's " b c" never follows P's " a"."""
    events, _ = _events(" x", {"temperature": 0})
    assert _text(events) == " a", events
    error = events[-1]["error"]
    assert error["type"] == "server_error" and "first token" in error["message"], error


def test_a_whole_answer_is_the_decode_engines_choice() -> None:
    """Not streamed: the answer is D's whole choice whatever the temperature."""
    p, d1, d2 = Engine("prefill", first=RESENDS), Engine("stream"), Engine("stream")
    r = asyncio.run(asked(p, d1, d2, stream=False, body={"temperature": 0.8}))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " b c"  # WHOLE: D's own text


def test_a_greedy_answer_that_ends_inside_ps_token_stops_unspliced() -> None:
    """D breaks the tie towards a shorter token and stops there: its " " is a prefix of
    P's " a" and ends the choice. The client must not get P's " a" as D's answer."""
    d_says = [_chunk(" ", "stop"), USAGE]
    p, d1, d2 = Engine("prefill", first=RESENDS), Engine("stream", stream=d_says), \
        Engine("stream")
    r = asyncio.run(asked(p, d1, d2, body={"temperature": 0}))
    events = [json.loads(line[5:]) for line in r.text.splitlines()
              if line.startswith("data:") and line != "data: [DONE]"]
    assert _text(events) == " a" and "error" in events[-1], events
    assert "inside" in events[-1]["error"]["message"]


def test_an_echo_behind_a_resending_engine_is_ds_whole_echo() -> None:
    """echo: D answers the whole choice, so it echoes the prompt itself (it is asked to);
    a sampled stream is D's echo and sequence, a greedy one P's echo and token first,
    matched against D's."""
    echoed = dict(RESENDS, choices=[dict(RESENDS["choices"][0], text="hi a")])
    for sampling in ({"temperature": 0.8}, {"temperature": 0}):
        d_says = [_chunk("hi", None), _chunk(" a", None), _chunk(" b", "length"), USAGE]
        p, d1, d2 = Engine("prefill", first=echoed), Engine("stream", stream=d_says), \
            Engine("stream")
        r = asyncio.run(asked(p, d1, d2, body={"echo": True, **sampling}))
        events = [json.loads(line[5:]) for line in r.text.splitlines()
                  if line.startswith("data:") and line != "data: [DONE]"]
        assert _text(events) == "hi a b" and not [e for e in events if "error" in e], events
        [(_, body, _)] = d1.posts
        assert body["echo"] is True
