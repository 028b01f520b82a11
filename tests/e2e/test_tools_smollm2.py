"""Tool calling with the embedded SmolLM2-135M-Instruct, through the openai client, on
``kvrelay serve --enable-auto-tool-choice --tool-call-parser hermes``.

SmolLM2's template ignores ``tools``: the server describes them in a system message in
Hermes' format, and earlier calls go back as ``<tool_call>`` text. A 135M model calls
on its own only after it has seen a call: the first turn forces one (``required``), the
later ones let the hermes parser read the model's own ``<tool_call>`` text (``auto``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from kvrelay.demo import ServerProcess
from tests.e2e.test_serve_smollm2 import MISSING, env

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("smollm2-tools") / "serve.log"
    proc = ServerProcess(["--max-model-len", "1024", "--dtype", "float32",
                          "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                         env=env(), log_path=str(log))
    proc.start()
    try:
        proc.wait_healthy(300)
        yield proc
    finally:
        assert proc.stop() == 0
        print(log.read_text()[-4000:])


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=120)


def _stream_calls(c: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, str]], Any]:
    content, calls, finish = "", {}, None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, ["", ""])
                if tc.function and tc.function.name:
                    assert tc.id and tc.id.startswith("call_")
                    slot[0] = tc.function.name
                if tc.function and tc.function.arguments:
                    slot[1] += tc.function.arguments
            finish = ch.finish_reason or finish
    return content, [(n, a) for n, a in calls.values()], finish


@pytest.mark.parametrize("stream", [False, True])
def test_tool_loop_required_then_auto(server: ServerProcess, stream: bool) -> None:
    c = _client(server)
    model = c.models.list().data[0].id
    kw: dict[str, Any] = dict(model=model, tools=TOOLS, temperature=0, max_tokens=40)
    r = c.chat.completions.create(messages=ASK, tool_choice="required",
                                  parallel_tool_calls=False, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"
    history = [*ASK, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"}]
    # auto: the model writes its own <tool_call> (it has seen one): the parser reads it.
    if stream:
        content, calls, finish = _stream_calls(c, messages=history, tool_choice="auto", **kw)
    else:
        r = c.chat.completions.create(messages=history, tool_choice="auto", **kw)
        m = r.choices[0].message
        content, finish = m.content or "", r.choices[0].finish_reason
        calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
    assert "<tool_call>" not in content
    assert finish == "tool_calls" and calls and calls[0][0] == "get_weather"
    assert json.loads(calls[0][1]) == {"city": "Paris"}
    # none: the same text comes back as content, unparsed.
    r = c.chat.completions.create(messages=history, tool_choice="none", **kw)
    assert r.choices[0].message.tool_calls is None
    assert "<tool_call>" in (r.choices[0].message.content or "")


# The operator's case (issue 42): a schema that lets the model add properties, parallel
# calls allowed (the default). At max_tokens 64 the model adds properties (named) or
# calls again and again (required) until it is cut: the answer is still its calls.
LOOSE: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice, stream", [("required", False), ("required", True),
                                                 (NAMED, False)],
                         ids=["required", "required-stream", "named"])
def test_forced_call_cut_by_max_tokens_is_tool_calls(server: ServerProcess, tool_choice: Any,
                                                     stream: bool) -> None:
    c = _client(server)
    kw: dict[str, Any] = dict(model=c.models.list().data[0].id, messages=ASK, tools=LOOSE,
                              tool_choice=tool_choice, temperature=0, max_tokens=64)
    if stream:
        content, calls, finish = _stream_calls(c, **kw)
    else:
        r = c.chat.completions.create(**kw)
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        calls = [(t.function.name, t.function.arguments)
                 for t in r.choices[0].message.tool_calls or []]
    assert finish == "length", "the model ended its calls: this no longer tests a cut one"
    assert not content and calls and all(name == "get_weather" for name, _ in calls)
    assert calls[0][1].replace(" ", "").startswith('{"city":"Paris"'), calls
