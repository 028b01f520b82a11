"""Tool calling pieces: the parsers of each model family, the streaming gate, the
validation of tools/tool_choice (400s naming the field), the forcing grammar, the
template messages and the streamed OpenAI layout."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import Tokenizer as HfTokenizer

from kvrelay.model.text.tokenizer import Tokenizer
from kvrelay.sampling_params import InvalidParameter
from kvrelay.server import cli
from kvrelay.server.api import tool_messages
from kvrelay.server.bodies import Collected, ToolChatShape
from kvrelay.server.generation import Delta
from kvrelay.testing.models import CHATML_TEMPLATE, tiny_tokenizer_json
from kvrelay.wire.http import ApiError, validate
from kvrelay.wire.openai import ChatCompletionRequest, LogprobFormatter
from kvrelay.wire.tools import (
    PARSERS,
    ContentGate,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    plan_tools,
)

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather",
                                                      "parameters": PARAMS}},
                    {"type": "function", "function": {"name": "now"}}]


def test_hermes_finds_calls_and_keeps_the_content_before() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "now", "arguments": {}}')  # last one unclosed
    content, calls = HermesParser().extract(text)
    assert content == "Let me look."
    assert calls == [ToolCall("get_weather", '{"city": "Oslo"}'), ToolCall("now", "{}")]


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>{not json}</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>'])
def test_hermes_text_without_a_parsable_call_is_content(text: str) -> None:
    assert HermesParser().extract(text) == (text, [])


def test_llama3_json_calls_separated_by_semicolons() -> None:
    text = ' {"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "now", ' \
           '"parameters": {}}'
    content, calls = Llama3JsonParser().extract(text)
    assert content is None
    assert calls == [ToolCall("get_weather", '{"city": "Rome"}'), ToolCall("now", "{}")]
    # Only at the start: JSON later in the text is content.
    later = 'The call would be {"name": "now", "parameters": {}}'
    assert Llama3JsonParser().extract(later) == (later, [])


def test_mistral_calls() -> None:
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern"}}]'
    assert MistralParser().extract(text) == (None, [ToolCall("get_weather",
                                                             '{"city": "Bern"}')])


def test_gate_streams_content_until_the_marker_even_split_across_deltas() -> None:
    gate = ContentGate(HermesParser())
    sent = [gate.feed(t) for t in ("Hi <", "tool", "_call>", '{"name": "now", ',
                                   '"arguments": {}}</tool_call>')]
    assert "".join(sent) == "Hi "
    assert sent[0] == "Hi "  # "<" held back: it may begin the marker
    assert gate.finish() == ("", [ToolCall("now", "{}")])
    plain = ContentGate(HermesParser())
    assert plain.feed("a <to") == "a "
    assert plain.feed("ast") == "<toast"  # not the marker after all
    assert plain.finish() == ("", [])


def test_gate_gives_back_unparsable_calls_as_content() -> None:
    gate = ContentGate(HermesParser())
    assert gate.feed("x <tool_call>{oops") == "x "
    assert gate.finish() == ("<tool_call>{oops", [])


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "fn"}], None, "tools[0].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], None,
     "tools[0].function.parameters"),
    ([TOOLS[0], TOOLS[0]], None, "tools[1].function.name"),
    (TOOLS, "maybe", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "other"}}, "tool_choice.function.name"),
    (None, "required", "tool_choice"),
    ([TOOLS[1]] * 129, None, "tools"),
])
def test_bad_tools_name_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(InvalidParameter) as info:
        plan_tools(tools, choice, None)
    assert info.value.param == param


def test_request_check_is_a_400_naming_the_field() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "tool_choice": "required", "response_format": {"type": "json_object"}}
    with pytest.raises(ApiError) as info:
        validate(body, ChatCompletionRequest).check()
    assert info.value.status == 400 and info.value.param == "response_format"


def test_default_choice_is_auto_and_none_without_tools() -> None:
    plan = plan_tools(TOOLS, None, None)
    assert plan is not None and plan.mode == "auto" and plan.structured() is None
    assert plan_tools(None, "none", None) is None


def test_required_grammar_lists_each_tool_and_honours_parallel_tool_calls() -> None:
    for parallel in (True, False):
        plan = plan_tools(TOOLS, "required", parallel)
        assert plan is not None
        spec = plan.structured()
        assert spec is not None and spec.grammar
        schema = json.loads(spec.schema)
        names = [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]]
        assert names == [["get_weather"], ["now"]] and schema["minItems"] == 1
        assert ("maxItems" in schema) is (not parallel)
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named is not None and json.loads(named.structured().schema) == PARAMS  # type: ignore[union-attr]


def test_forced_output_as_calls() -> None:
    plan = plan_tools(TOOLS, "required", None)
    assert plan is not None
    whole = plan.forced('[{"name":"now","parameters":{}},{"name":"get_weather",'
                        '"parameters":{"city":"Oslo"}}]')
    assert whole.whole and whole.calls == (ToolCall("now", "{}"),
                                           ToolCall("get_weather", '{"city": "Oslo"}'))


@pytest.mark.parametrize("text, calls", [
    ('[{"name":"now","param', ()),  # no call has its name and arguments yet
    ('[{"name":"get_weather","parameters":{"city":"Os', (
        ToolCall("get_weather", '{"city":"Os'),)),
    ('[{"name":"now","parameters":{}},{"name":"get_weather","parameters":', (
        ToolCall("now", "{}"), ToolCall("get_weather", ""))),
    ('[{"name":"now","parameters":{}},{"name":"get_wea', (ToolCall("now", "{}"),)),
    ('[{"name":"now","parameters":{}}', (ToolCall("now", "{}"),)),  # before the "]"
    ('[{"name":"get_weather","parameters":{"city":"Oslo"}', (  # before the element's "}"
        ToolCall("get_weather", '{"city": "Oslo"}'),)),
])
def test_required_cut_keeps_its_calls_the_last_one_partial(text: str, calls: Any) -> None:
    """As vLLM streams a cut array: each call once its name is whole, its arguments as
    far as they came."""
    plan = plan_tools(TOOLS, "required", None)
    assert plan is not None
    forced = plan.forced(text)
    assert forced.calls == calls and not forced.whole


def test_named_output_is_the_call_whole_or_cut() -> None:
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert plan is not None
    assert plan.forced('{"city":"Oslo"}').calls == (ToolCall("get_weather", '{"city":"Oslo"}'),)
    assert plan.forced('{"city":"Oslo"}').whole
    cut = plan.forced('{"city":"Os')
    assert cut.calls == (ToolCall("get_weather", '{"city":"Os'),) and not cut.whole
    assert plan.forced("").calls == ()


def _tokenizer() -> Tokenizer:
    return Tokenizer(HfTokenizer.from_str(tiny_tokenizer_json()), vocab_size=64,
                     chat_template=CHATML_TEMPLATE, bos_token=None, eos_token="<|im_end|>")


def test_template_without_tools_gets_them_described_and_calls_as_text() -> None:
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather",
                                          "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    text = _tokenizer().apply_chat_template(tool_messages(msgs, TOOLS, CHATML_TEMPLATE))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>tool\nSunny<|im_end|>" in text


def test_template_that_knows_tool_calls_gets_arguments_as_an_object() -> None:
    template = "{% for m in messages %}{{ m.tool_calls | tojson }}{% endfor %}{{ tools }}"
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    out = tool_messages(msgs, TOOLS, template)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert len(out) == 1  # no description: the template renders tools itself


def _shape(choice: Any, auto: Any = None) -> ToolChatShape:
    plan = plan_tools(TOOLS, choice, None)
    assert plan is not None
    return ToolChatShape("id", "m", False, LogprobFormatter(str), plan, auto)


def _stream(shape: ToolChatShape, pieces: list[str], finish: str = "stop"
            ) -> list[dict[str, Any]]:
    out = []
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        d = Delta(0, p, [1], None, finish if last else None)
        out += [c["choices"][0] for c in shape.chunks(d, 0)]
    return out


def test_named_streams_arguments_after_a_first_delta_with_id_and_name() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = _stream(_shape(named), ['{"city":', '"Oslo"}'])
    first = chunks[0]["delta"]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(c["delta"]["tool_calls"][0]["function"]["arguments"] for c in chunks[1:-1])
    assert args == '{"city":"Oslo"}'
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_required_stream_sends_the_calls_at_the_end() -> None:
    chunks = _stream(_shape("required"), ['[{"name":"now",', '"parameters":{}}]'])
    (calls,) = [c["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["delta"]]
    assert [(c["index"], c["function"]) for c in calls] == [
        (0, {"name": "now", "arguments": "{}"})]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert not any(c["delta"].get("content") for c in chunks)


NAMED = {"type": "function", "function": {"name": "get_weather"}}
CUT_REQUIRED = ['[{"name":"now","parameters":{}},', '{"name":"get_weather","parameters":',
                '{"city":"Os']


def _streamed_calls(chunks: list[dict[str, Any]]) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for tc in c["delta"].get("tool_calls", []):
            slot = calls.setdefault(tc["index"], ["", ""])
            slot[0] += tc["function"].get("name") or ""
            slot[1] += tc["function"].get("arguments") or ""
    return [(n, a) for n, a in calls.values()]


@pytest.mark.parametrize("choice, pieces, finish, calls", [
    (NAMED, ['{"city":', '"Os'], "length", [("get_weather", '{"city":"Os')]),
    (NAMED, ['{"city":', '"Oslo"}'], "tool_calls", [("get_weather", '{"city":"Oslo"}')]),
    ("required", CUT_REQUIRED, "length", [("now", "{}"), ("get_weather", '{"city":"Os')]),
    ("required", [*CUT_REQUIRED, 'lo"}}]'], "tool_calls",
     [("now", "{}"), ("get_weather", '{"city": "Oslo"}')]),
])
def test_forced_calls_are_calls_whole_or_streamed_cut_or_not(choice: Any, pieces: list[str],
                                                              finish: str, calls: Any) -> None:
    """A cut call is a call all the same, finish ``length``; whole and streamed agree."""
    engine_finish = "length" if finish == "length" else "stop"
    out = _shape(choice).full_choice(0, Collected(text=pieces, finish_reason=engine_finish))
    assert out["finish_reason"] == finish and out["message"]["content"] is None
    assert [(t["function"]["name"], t["function"]["arguments"])
            for t in out["message"]["tool_calls"]] == calls
    chunks = _stream(_shape(choice), pieces, engine_finish)
    assert _streamed_calls(chunks) == calls and chunks[-1]["finish_reason"] == finish
    assert not any(c["delta"].get("content") for c in chunks)


def test_auto_stream_content_then_calls() -> None:
    chunks = _stream(_shape("auto", HermesParser()),
                     ["Sure. <tool", '_call>{"name": "now", "arguments": {}}</tool_call>'])
    content = "".join(c["delta"].get("content", "") for c in chunks)
    assert content == "Sure. "
    assert any("tool_calls" in c["delta"] for c in chunks)
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_full_choice_layout() -> None:
    c = Collected(text=['[{"name":"now","parameters":{}}]'], finish_reason="stop")
    out = _shape("required").full_choice(0, c)
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
    (call,) = out["message"]["tool_calls"]
    assert call["function"] == {"name": "now", "arguments": "{}"} and call["type"] == "function"
    cut = _shape("required").full_choice(0, Collected(text=['[{"na'], finish_reason="length"))
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == '[{"na'
    assert "tool_calls" not in cut["message"]


def test_cli_parsers_are_the_implemented_ones() -> None:
    assert set(cli.TOOL_PARSERS) == set(PARSERS)


def test_auto_flag_without_parser_is_a_usage_error() -> None:
    from kvrelay.cli import main

    assert main(["serve", "--enable-auto-tool-choice", "--port", "1"]) == 2
