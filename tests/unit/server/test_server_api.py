"""The HTTP API on stand-in model parts (byte tokenizer, letter runner), over real sockets.

One uvicorn server in a thread per module; the official ``openai`` client and raw
httpx drive it. Outputs are exactly predictable (``expected_letters``).
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.metrics_util import metrics, sample, wait_blocks_back
from tests.unit.server.fakes import (
    ByteTokenizer,
    expected_letters,
    make_state,
    serve_in_thread,
)

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_in_thread(make_state(num_blocks=256, max_model_len=256, delay_s=0.003)) as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def chat_prompt_len(content: str) -> int:
    text = TOK.apply_chat_template([{"role": "user", "content": content}])
    return len(TOK.encode(text, add_special_tokens=False))


# -- completions and chat ---------------------------------------------------------------
def test_completion_matches_engine_output(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=7, seed=3)
    assert r.choices[0].text == expected_letters(3, 6, 7)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 7, 13)
    assert r.object == "text_completion" and r.model == "tiny"


def test_completion_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model="tiny-alias", prompt="hello", max_tokens=9, seed=5, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_letters(5, 6, 9)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompt_and_batch(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=["ab", "abcd"], max_tokens=4, seed=1)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == expected_letters(1, 3, 4)
    assert r.choices[1].text == expected_letters(1, 5, 4)
    r = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3, seed=1)
    assert r.choices[0].text == expected_letters(1, 3, 3)
    assert r.usage.prompt_tokens == 3


def test_n_choices_use_consecutive_seeds(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="x", max_tokens=5, seed=10, n=3)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [
        expected_letters(10 + i, 2, 5) for i in range(3)
    ]
    assert r.usage.completion_tokens == 15 and r.usage.prompt_tokens == 2


def test_chat_full_and_streamed(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "hi there"}]
    n = chat_prompt_len("hi there")
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, seed=2)
    assert r.choices[0].message.content == expected_letters(2, n, 6)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == n
    chunks = list(client.chat.completions.create(
        model="tiny", messages=msgs, max_completion_tokens=6, seed=2, stream=True
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_letters(2, n, 6)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_output_and_frees_blocks(client: openai.OpenAI, url: str) -> None:
    full = expected_letters(4, 6, 40)
    stop = full[10:12]
    cut = full.index(stop)
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=40, seed=4, stop=stop)
    assert r.choices[0].text == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="hello", max_tokens=40, seed=4, stop=[stop], stream=True,
    ))
    assert streamed == full[:cut]
    r = client.completions.create(
        model="tiny", prompt="hello", max_tokens=40, seed=4, stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert r.choices[0].text == full[: cut + 2]
    wait_blocks_back(url, 5.0)


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="hey", max_tokens=3, seed=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs == [-0.5] * 3 and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset == [0, 1, 2]
    c = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3, seed=0,
        logprobs=True, top_logprobs=3,
    )
    content = c.choices[0].logprobs.content
    assert [e.token for e in content] == list(c.choices[0].message.content)
    assert len(content[0].top_logprobs) == 3


def test_sixteen_concurrent_requests(client: openai.OpenAI, url: str) -> None:
    def one(i: int) -> str:
        r = client.completions.create(model="tiny", prompt="p" * (i + 1), max_tokens=12, seed=i)
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(16)))
    assert texts == [expected_letters(i, i + 2, 12) for i in range(16)]
    wait_blocks_back(url, 5.0)


# -- abort on disconnect -------------------------------------------------------------------
def test_streaming_disconnect_aborts_and_frees_blocks(url: str) -> None:
    before = sample(metrics(url), "kvrelay_requests_finished_total", reason="abort")
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data")]
        assert len(got) >= 3
        m = metrics(url)
        assert sample(m, "kvrelay_kv_blocks_free") < sample(m, "kvrelay_kv_blocks_total")
    m = wait_blocks_back(url, 5.0)
    assert sample(m, "kvrelay_requests_finished_total", reason="abort") == before + 1
    assert sample(m, "kvrelay_requests_running") == 0


def test_non_streaming_disconnect_aborts(url: str) -> None:
    before = sample(metrics(url), "kvrelay_requests_finished_total", reason="abort")
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 200}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=0.15)
    m = wait_blocks_back(url, 5.0)
    assert sample(m, "kvrelay_requests_finished_total", reason="abort") == before + 1


# -- errors --------------------------------------------------------------------------------
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD_INPUTS = [
    (CMPL, "{not json", 400, None),
    (CMPL, "[1, 2]", 400, None),
    (CMPL, '{"model": "tiny", "prompt": "a", "temperature": NaN}', 400, None),
    (CMPL, '{"model": "tiny", "prompt": "a", "unknown": -Infinity}', 400, None),
    (CMPL, '{"model": "tiny", "prompt": "a\\ud800"}', 400, "prompt"),
    (CMPL, '{"model": "tiny", "prompt": ["ok", "\\udfff"]}', 400, "prompt[1]"),
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages[0].content"),
    (CMPL, {"prompt": "a"}, 400, "model"),
    (CMPL, {"model": "tiny"}, 400, "prompt"),
    (CMPL, {"model": "tiny", "prompt": 5}, 400, "prompt"),
    (CMPL, {"model": "tiny", "prompt": ""}, 400, "prompt"),
    (CMPL, {"model": "tiny", "prompt": []}, 400, "prompt"),
    (CMPL, {"model": "tiny", "prompt": [1, 999]}, 400, "prompt"),
    (CMPL, {"model": "tiny", "prompt": "x" * 300}, 400, "prompt"),
    # The first prompt of the batch is admitted, the second rejected: the first is undone.
    (CMPL, {"model": "tiny", "prompt": ["ok", "x" * 300], "max_tokens": 50}, 400, "prompt"),
    (CMPL, {"model": "tiny", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"model": "tiny", "prompt": "a", "max_tokens": 100000}, 400, "max_tokens"),
    (CMPL, {"model": "tiny", "prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    (CMPL, {"model": "tiny", "prompt": "a", "temperature": 2.5}, 400, "temperature"),
    (CMPL, {"model": "tiny", "prompt": "a", "temperature": -1}, 400, "temperature"),
    (CMPL, {"model": "tiny", "prompt": "a", "top_p": 0}, 400, "top_p"),
    (CMPL, {"model": "tiny", "prompt": "a", "top_p": 1.5}, 400, "top_p"),
    (CMPL, {"model": "tiny", "prompt": "a", "n": 0}, 400, "n"),
    (CMPL, {"model": "tiny", "prompt": "a", "logprobs": 50}, 400, "logprobs"),
    (CMPL, {"model": "tiny", "prompt": "a", "stop": [""]}, 400, "stop"),
    (CMPL, {"model": "tiny", "prompt": "a", "stream": "maybe"}, 400, "stream"),
    (CMPL, {"model": "nope", "prompt": "a"}, 404, "model"),
    (CHAT, {"model": "tiny"}, 400, "messages"),
    (CHAT, {"model": "tiny", "messages": []}, 400, "messages"),
    (CHAT, {"model": "tiny", "messages": "hi"}, 400, "messages"),
    (CHAT, {"model": "tiny", "messages": [{"content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x" * 300}]}, 400,
     "messages"),
    (CHAT, {"model": "tiny", "messages": MSG, "max_completion_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"model": "tiny", "messages": MSG, "temperature": 9}, 400, "temperature"),
    (CHAT, {"model": "tiny", "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"model": "nope", "messages": MSG}, 404, "model"),
    # vLLM's sampling parameters, out of range; and known ones kvrelay does not implement.
    (CMPL, {"model": "tiny", "prompt": "a", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    (CMPL, {"model": "tiny", "prompt": "a", "presence_penalty": -3}, 400, "presence_penalty"),
    (CMPL, {"model": "tiny", "prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CMPL, {"model": "tiny", "prompt": "a", "max_tokens": 4, "min_tokens": 5}, 400,
     "min_tokens"),
    (CMPL, {"model": "tiny", "prompt": "a", "bad_words": [""]}, 400, "bad_words"),
    (CMPL, {"model": "tiny", "prompt": "a", "bad_words": ["x"] * 129}, 400, "bad_words"),
    (CMPL, {"model": "tiny", "prompt": "a", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (CMPL, {"model": "tiny", "prompt": "a", "allowed_token_ids": [1, 999]}, 400,
     "allowed_token_ids"),
    (CMPL, {"model": "tiny", "prompt": "a", "best_of": 2}, 400, "best_of"),
    (CMPL, {"model": "tiny", "prompt": "a", "use_beam_search": True}, 400, "use_beam_search"),
    (CMPL, {"model": "tiny", "prompt": "a", "length_penalty": 0.5}, 400, "length_penalty"),
    (CMPL, {"model": "tiny", "prompt": "a", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (CHAT, {"model": "tiny", "messages": MSG, "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs"),
    (CHAT, {"model": "tiny", "messages": MSG, "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    (CMPL, {"model": "tiny", "prompt": "a", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs"),
    (CMPL, {"model": "tiny", "prompt": "a", "guided_json": {}}, 400, "guided_json"),
    (CMPL, {"model": "tiny", "prompt": "a", "guided_choice": ["a"]}, 400, "guided_choice"),
    (CMPL, {"model": "tiny", "prompt": "a", "skip_special_tokens": False}, 400,
     "skip_special_tokens"),
    (CHAT, {"model": "tiny", "messages": MSG, "echo": True}, 400, "echo"),
    (CHAT, {"model": "tiny", "messages": MSG, "continue_final_message": True}, 400,
     "continue_final_message"),
    (CHAT, {"model": "tiny", "messages": MSG, "chat_template": "{{ x }}"}, 400,
     "chat_template"),
    (CHAT, {"model": "tiny", "messages": MSG, "functions": [{"name": "f"}]}, 400, "functions"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS)
def test_bad_input_names_the_field(
    url: str, path: str, body: object, status: int, param: str | None
) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]


def test_defaults_of_unsupported_fields_and_unknown_fields_are_accepted(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Clients send defaults explicitly (best_of 1, use_beam_search false): no error.
    A field nobody knows is dropped with a warning in the log, as vLLM does."""
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 2, "best_of": 1,
            "use_beam_search": False, "length_penalty": 1.0, "prompt_logprobs": None,
            "skip_special_tokens": True, "no_such_field": 1}
    with caplog.at_level("WARNING", logger="kvrelay.wire.http"):
        r = httpx.post(url + CMPL, json=body)
    assert r.status_code == 200, r.text
    assert any("no_such_field" in rec.getMessage() for rec in caplog.records)


def test_n_choices_streamed(client: openai.OpenAI) -> None:
    texts = ["", ""]
    finish: dict[int, str | None] = {}
    for c in client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=4, seed=7, n=2, stream=True
    ):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    n = chat_prompt_len("hi")
    assert texts == [expected_letters(7, n, 4), expected_letters(8, n, 4)]
    assert finish == {0: "length", 1: "length"}


def test_hostile_bodies(url: str) -> None:
    r = httpx.post(url + CMPL, content=b"[" * 100_000)
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    r = httpx.post(url + CMPL, content=b"\xff\xfe")
    assert r.status_code == 400
    r = httpx.post(url + CMPL, content=b" " * (17 * 1024 * 1024))
    assert r.status_code == 413
    # Issue 21: an integer of more digits than int() takes was a 500.
    r = httpx.post(url + CMPL, content=b'{"max_tokens": ' + b"9" * 5000 + b"}")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_server_survives_bad_input(url: str) -> None:
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(url + CMPL)
    assert r.status_code == 405 and "error" in r.json()
    wait_blocks_back(url, 5.0)


def test_plain_endpoints(url: str) -> None:
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/version").json()["version"]
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
    text = httpx.get(url + "/metrics").text
    for name in (
        "kvrelay_kv_blocks_total", "kvrelay_kv_blocks_free", "kvrelay_requests_running",
        "kvrelay_requests_waiting", "kvrelay_prompt_tokens_total",
        "kvrelay_generation_tokens_total", "kvrelay_time_to_first_token_seconds_bucket",
        "kvrelay_inter_token_latency_seconds_bucket", "kvrelay_e2e_request_latency_seconds_sum",
    ):
        assert name in text


# -- API key -------------------------------------------------------------------------------
def test_api_key() -> None:
    with serve_in_thread(make_state(api_key="sesame")) as url:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
        r = httpx.post(url + CMPL, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["param"] == "Authorization"
        r = httpx.post(url + CMPL, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert httpx.get(url + "/v1/models").status_code == 401
        good = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(**body).usage.completion_tokens == 2
        assert httpx.get(url + "/health").status_code == 200
