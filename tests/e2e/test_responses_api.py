"""``/v1/responses`` through the openai client's ``responses.create`` and
``responses.stream``, on a colocated ``kvrelay serve`` and on 1P1D behind the proxy (real
processes, a tiny random model): text, instructions, a tool loop with function_call and
function_call_output items, previous_response_id, text.format, and 400s naming the field.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.cluster import Proc, colocated_and_pd, metric, pools_free
from tests.e2e.tool_schemas import TIME, WEATHER, roomy_tiny_model, valid_args
from tests.metrics_util import metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Weather",
     "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": TIME, "strict": True},
]
ASK = "Weather in Paris for 3 days?"
WHERE = ["colo", "proxy"]


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    model = roomy_tiny_model(tmp_path_factory)
    with colocated_and_pd(model, tmp_path_factory.mktemp("responses-logs"), "--num-blocks",
                          "1024") as (_, out):
        yield out


def client(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=90)


def model_of(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items()
                                                 if k in ("name", "description", "parameters")}}
              for t in TOOLS]


def _tokens(proc: Proc, messages: list[dict[str, Any]], tools: Any = None) -> int:
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    r = httpx.post(proc.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


@pytest.mark.parametrize("where", WHERE)
def test_text_with_instructions(procs: dict[str, Proc], where: str) -> None:
    """The prompt is the chat template of instructions (a system message) and the input;
    the answer is chat's, token for token (greedy); usage counts both."""
    c = client(procs[where])
    m = model_of(c)
    r = c.responses.create(model=m, input="Hello there", instructions="Be brief.",
                           max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "Be brief." and r.max_output_tokens == 6
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user",
                                                            "content": "Hello there"}]
    chat = c.chat.completions.create(model=m, messages=messages, max_tokens=6, temperature=0)
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens == _tokens(procs["colo"],
                                                                        messages)
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6


@pytest.mark.parametrize("where", WHERE)
def test_stream_events_as_the_sdk_parses_them(procs: dict[str, Proc], where: str) -> None:
    c = client(procs[where])
    m = model_of(c)
    kw: dict[str, Any] = dict(model=m, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": " there"}]}],
        max_output_tokens=8, temperature=0)
    whole = c.responses.create(**kw)
    with c.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text and deltas
    assert final.usage is not None and final.usage.output_tokens == 8
    assert final.id == events[0].response.id  # type: ignore[union-attr]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_loop(procs: dict[str, Proc], where: str, stream: bool, choice: str) -> None:
    """function_call out, function_call_output back in, a text answer: the tool loop."""
    c = client(procs[where])
    m = model_of(c)
    tool_choice: Any = "required" if choice == "required" else {"type": "function",
                                                                 "name": "get_weather"}
    kw: dict[str, Any] = dict(model=m, tools=TOOLS, max_output_tokens=80, temperature=1.0,
                              extra_body={"seed": 3})
    first = _create(c, stream, input=ASK, tool_choice=tool_choice, parallel_tool_calls=False,
                    **kw)
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.call_id.startswith("call_")
    assert call.status == "completed"
    if choice == "named":
        assert call.name == "get_weather"
    assert valid_args(call.name, call.arguments), call.arguments
    result = "Sunny, 21C"
    history: list[Any] = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                          {"type": "function_call_output", "call_id": call.call_id,
                           "output": result}]
    final = _create(c, stream, input=history, tool_choice="none", **kw)
    assert [o.type for o in final.output] == ["message"] and final.output_text
    # The call and its result reached the prompt: it is the template of the same turns.
    chat_turns = [{"role": "user", "content": ASK},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    assert final.usage is not None
    assert final.usage.input_tokens == _tokens(procs["colo"], chat_turns, CHAT_TOOLS)


def _create(c: openai.OpenAI, stream: bool, **kw: Any) -> Any:
    if not stream:
        return c.responses.create(**kw)
    with c.responses.stream(**kw) as s:
        for _ in s:
            pass
        return s.get_final_response()


@pytest.mark.parametrize("where", WHERE)
def test_previous_response_id(procs: dict[str, Proc], where: str) -> None:
    """A follow-up is served with the stored conversation before its input (without the
    earlier instructions); store: false keeps nothing."""
    c = client(procs[where])
    m = model_of(c)
    first = c.responses.create(model=m, input="Hi", instructions="Be kind.",
                               max_output_tokens=5, temperature=0)
    second = c.responses.create(model=m, input="And then?", previous_response_id=first.id,
                                max_output_tokens=5, temperature=0)
    assert second.previous_response_id == first.id
    turns = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And then?"}]
    assert second.usage is not None
    assert second.usage.input_tokens == _tokens(procs["colo"], turns)
    again = c.responses.create(model=m, input=turns, max_output_tokens=5, temperature=0)
    assert again.output_text == second.output_text
    gone = c.responses.create(model=m, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model=m, input="x", previous_response_id=gone.id,
                           max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.parametrize("where", WHERE)
def test_text_format_json_schema(procs: dict[str, Proc], where: str) -> None:
    c = client(procs[where])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    r = c.responses.create(model=model_of(c), input="Answer in JSON", max_output_tokens=40,
                           text={"format": {"type": "json_schema", "name": "answer",
                                            "schema": schema, "strict": True}})
    assert r.status == "completed"
    doc = json.loads(r.output_text)
    assert list(doc) == ["ok"] and isinstance(doc["ok"], bool)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"input": "x", "tools": TOOLS}, "tool_choice"),  # auto needs the parser flags
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": 7}, "input"),
]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("body, param", BAD)
def test_bad_input_is_400_naming_the_field(procs: dict[str, Proc], where: str,
                                           body: dict[str, Any], param: str) -> None:
    r = httpx.post(procs[where].url + "/v1/responses", timeout=30,
                   json={"model": model_of(client(procs[where])), **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_proxy_refuses_a_body_that_is_not_an_object(procs: dict[str, Proc]) -> None:
    """Not JSON at all, and a JSON array: 400s from the proxy itself."""
    for raw in (b"{not json", b"[1, 2]"):
        r = httpx.post(procs["proxy"].url + "/v1/responses", content=raw, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()


@pytest.mark.parametrize("where", WHERE)
def test_a_client_that_leaves_mid_stream_aborts_it(procs: dict[str, Proc], where: str) -> None:
    """The stream's client goes after the first delta: the engine aborts the generation
    (through the proxy too: the proxy closes its own upstream stream) and frees its KV."""
    engine = procs["colo" if where == "colo" else "d"]
    query = 'kvrelay_requests_finished_total{reason="abort"}'
    before = metric(metrics(engine.url), query)
    body = {"model": model_of(client(procs[where])), "input": "Tell me everything",
            "max_output_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", procs[where].url + "/v1/responses", json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"response.output_text.delta"' in line:
                break  # and the connection closes
    deadline = time.monotonic() + 30
    while metric(metrics(engine.url), query) == before:
        assert time.monotonic() < deadline, "the engine never aborted the generation"
        time.sleep(0.05)
    pools_free(engine)
