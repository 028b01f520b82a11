"""The Responses API's translation into chat, its validation, its event sequence and its
bounded store (kvrelay.server.responses_api, kvrelay.server.responses_output)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvrelay.server.generation import Delta
from kvrelay.server.responses_api import ResponsesRequest, input_messages, renamed, to_chat
from kvrelay.server.responses_output import Output, ResponseStore, Settings
from kvrelay.wire.http import ApiError, validate
from kvrelay.wire.openai import ChatCompletionRequest
from kvrelay.wire.tools import HermesParser, plan_tools

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "w", "parameters": SCHEMA,
        "strict": True}


def req(**body: Any) -> ResponsesRequest:
    return validate({"model": "m", **body}, ResponsesRequest)


def test_text_input_and_instructions_make_chat_messages() -> None:
    body, turn = to_chat(req(input="hi", instructions="be kind", max_output_tokens=5,
                             temperature=0.5, top_p=0.9), [])
    assert body["messages"] == [{"role": "system", "content": "be kind"},
                                {"role": "user", "content": "hi"}]
    assert turn == [{"role": "user", "content": "hi"}]  # instructions are not carried over
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (5, 0.5, 0.9)
    assert "tools" not in body and "response_format" not in body


def test_history_goes_between_instructions_and_input() -> None:
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    body, _ = to_chat(req(input="c", instructions="sys"), history)
    assert [m["content"] for m in body["messages"]] == ["sys", "a", "b", "c"]


def test_function_call_items_become_one_assistant_turn_and_tool_messages() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "wea"},
                                     {"type": "input_text", "text": "ther?"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
         "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "done", "annotations": []}]},
    ]
    assert input_messages(items) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\":1}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "done"},
    ]


def test_a_call_after_assistant_text_joins_that_turn() -> None:
    out = input_messages([{"role": "assistant", "content": "let me look"},
                          {"type": "function_call", "call_id": "c", "name": "f",
                           "arguments": "{}"}])
    assert len(out) == 1 and out[0]["content"] == "let me look" and len(out[0]["tool_calls"]) == 1


def test_tools_tool_choice_and_text_format_in_chat_shape() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    body, _ = to_chat(req(input="x", tools=[TOOL], parallel_tool_calls=False,
                          tool_choice={"type": "function", "name": "get_weather"}), [])
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "w", "parameters": SCHEMA}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    chat = validate(body, ChatCompletionRequest)
    chat.check()
    plan = chat.tool_plan
    assert plan is not None and plan.mode == "named" and plan.name == "get_weather"
    body, _ = to_chat(req(input="x", text={"format": {"type": "json_schema", "name": "a",
                                                      "schema": schema, "strict": True}}), [])
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "a", "schema": schema, "strict": True}}


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [3]}, "input[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
     "input[0].output"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
])
def test_translation_errors_name_the_responses_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        to_chat(req(**body), [])
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("field, value", [
    ("background", True), ("conversation", "conv_1"), ("include", ["file_search_call.results"]),
    ("reasoning", {"effort": "high"}), ("truncation", "auto"), ("top_logprobs", 2),
    ("prompt", {"id": "pmpt_1"}), ("max_tool_calls", 3),
])
def test_unsupported_fields_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ApiError) as info:
        req(input="x", **{field: value})
    assert info.value.status == 400 and info.value.param == field


@pytest.mark.parametrize("field, value", [
    ("background", False), ("include", []), ("reasoning", {"effort": None}),
    ("truncation", "disabled"), ("user", "u"), ("prompt_cache_key", "k"),
])
def test_their_off_values_and_harmless_fields_pass(field: str, value: Any) -> None:
    assert req(input="x", **{field: value}).input == "x"


def test_chat_errors_are_renamed() -> None:
    e = renamed(ApiError(400, "tools[0].function.name must be 1 to 64 letters",
                         param="tools[0].function.name"))
    assert e.param == "tools[0].name" and e.message.startswith("tools[0].name ")
    e = renamed(ApiError(400, "max_tokens must be >= 1, got 0", param="max_tokens"))
    assert e.param == "max_output_tokens" and "max_output_tokens" in e.message
    e = renamed(ApiError(400, "bad", param="response_format.json_schema.schema"))
    assert e.param == "text.format.schema"


# -- output ---------------------------------------------------------------------------
def settings() -> Settings:
    return Settings("m", None, None, 1.0, 1.0, [], "auto", True, {"format": {"type": "text"}},
                    None, True, None)


def run(out: Output, texts: list[str], finish: str = "stop") -> list[dict[str, Any]]:
    events = out.start()
    for i, t in enumerate(texts):
        events += out.feed(Delta(0, t, [1], None, finish if i == len(texts) - 1 else None))
    events.append(out.completed(3, len(texts)))
    return events


def test_text_events_in_openai_order_and_numbered() -> None:
    events = run(Output("resp_1", settings(), None, None), ["Hel", "lo"])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["input_tokens"] == 3 and final["usage"]["total_tokens"] == 5


def test_nothing_generated_is_one_empty_message() -> None:
    out = Output("r", settings(), None, None)
    out.start()
    out.feed(Delta(0, "", [2], None, "stop"))
    (item,) = out.final(3, 1)["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == ""


def test_vllm_sampling_extras_reach_the_chat_request() -> None:
    body, _ = to_chat(req(input="x", seed=4, top_k=3, stop=["\n"], min_tokens=2,
                          logit_bias={"5": 1.0}, repetition_penalty=1.1), [])
    assert (body["seed"], body["top_k"], body["stop"], body["min_tokens"]) == (4, 3, ["\n"], 2)
    assert body["logit_bias"] == {"5": 1.0} and body["repetition_penalty"] == 1.1
    assert "min_p" not in body  # unset stays unset: chat's defaults


def test_cut_by_max_output_tokens_is_incomplete() -> None:
    final = run(Output("r", settings(), None, None), ["a"], finish="length")[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def _plan(choice: Any) -> Any:
    return plan_tools([{"type": "function", "function": {"name": "get_weather",
                                                         "parameters": SCHEMA}}], choice, False)


def test_required_calls_become_function_call_items() -> None:
    out = Output("r", settings(), _plan("required"), None)
    events = run(out, ['[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}]'])
    call = events[-1]["response"]["output"][0]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Oslo"}
    assert call["call_id"].startswith("call_") and call["status"] == "completed"
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call["arguments"]
    assert out.messages() == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call["call_id"], "type": "function",
         "function": {"name": "get_weather", "arguments": call["arguments"]}}]}]


def test_required_cut_by_max_output_tokens_is_still_function_calls() -> None:
    """As a chat answer: the array's calls, the one it was cut in marked incomplete with
    its arguments as far as they came."""
    out = Output("r", settings(), _plan("required"), None)
    final = run(out, ['[{"name":"get_weather",', '"parameters":{"city":"Os'],
                finish="length")[-1]["response"]
    (call,) = final["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["arguments"] == '{"city":"Os' and call["status"] == "incomplete"
    assert final["status"] == "incomplete"


def test_named_arguments_stream_as_they_come() -> None:
    events = run(Output("r", settings(), _plan({"type": "function", "function": {
        "name": "get_weather"}}), None), ['{"city"', ': "Oslo"}'])
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_item.added") < kinds.index(
        "response.function_call_arguments.delta")
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"city"', ': "Oslo"}']
    assert events[-1]["response"]["output"][0]["arguments"] == '{"city": "Oslo"}'


def test_auto_text_then_parsed_call() -> None:
    out = Output("r", settings(), _plan("auto"), HermesParser())
    events = run(out, ["Let me see. <tool_", 'call>{"name": "get_weather", "arguments": '
                       '{"city": "Oslo"}}</tool_call>'])
    output = events[-1]["response"]["output"]
    assert [o["type"] for o in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"] == "Let me see. "
    assert json.loads(output[1]["arguments"]) == {"city": "Oslo"}


def test_store_is_lru_and_bounded_in_count_and_bytes() -> None:
    s = ResponseStore(max_count=2, max_bytes=200)
    msg = [{"role": "user", "content": "x" * 40}]
    assert s.put("a", msg) and s.put("b", msg)
    assert s.get("a") is not None  # a is now the most recently used
    assert s.put("c", msg)
    assert s.get("b") is None and s.get("a") is not None and len(s) == 2
    assert not s.put("huge", [{"role": "user", "content": "x" * 500}])  # over the bound alone
    big = [{"role": "user", "content": "x" * 120}]
    assert s.put("d", big)
    assert s.bytes <= 200 and s.get("d") is not None and len(s) == 1
    got = s.get("d")
    assert got is not None
    got[0]["content"] = "changed"  # a copy: the stored conversation stays
    assert s.get("d") == big


def test_the_proxy_sends_a_follow_up_to_the_engine_that_made_the_response() -> None:
    from kvrelay.proxy.responses import ResponseRouter
    from kvrelay.proxy.routing import Proxy

    proxy = Proxy(["http://p"], ["http://d1", "http://d2", "http://d3"])
    router = ResponseRouter(proxy, max_remembered=2)
    proxy.decode.all[0].outstanding = 0  # d1 is the least loaded
    proxy.decode.all[1].outstanding = proxy.decode.all[2].outstanding = 3
    router.remember("resp_a", "http://d2")
    router.remember("resp_b", "http://d3")
    assert router.order("resp_a")[0].url == "http://d2"
    assert router.order("resp_b")[0].url == "http://d3"
    assert router.order(None)[0].url == "http://d1" == router.order(["x"])[0].url
    router.remember("resp_c", "http://d2")  # bounded: resp_a, the oldest, is forgotten
    assert router.order("resp_a")[0].url == "http://d1"
    assert [u.url for u in router.order("resp_c")] == ["http://d2", "http://d1", "http://d3"]
