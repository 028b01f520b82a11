"""The Responses API and LangChain with the embedded SmolLM2-135M-Instruct on ``kvrelay
serve --enable-auto-tool-choice --tool-call-parser hermes``: a real model calls the tool
with the right arguments (the city the user named), the result goes back, it answers.

A 135M model calls reliably when made to: the call is forced (``required`` or the named
function), the answer after the result is asked for with ``tool_choice`` ``none``.
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

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
          "required": ["city"], "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather",
                     "description": "Get the current weather in a city", "parameters": SCHEMA}]
ASK = "What is the weather in Paris?"
RESULT = "Sunny, 21 degrees"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("smollm2-responses") / "serve.log"
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


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_loop(server: ServerProcess, stream: bool) -> None:
    c = _client(server)
    kw: dict[str, Any] = dict(model=c.models.list().data[0].id, tools=TOOLS, temperature=0,
                              max_output_tokens=40)
    first = _create(c, stream, input=ASK, tool_choice="required", parallel_tool_calls=False,
                    **kw)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    # The call and its result go back by previous_response_id: only the result is sent.
    final = _create(c, stream, previous_response_id=first.id, tool_choice="none",
                    input=[{"type": "function_call_output", "call_id": call.call_id,
                            "output": RESULT}], **kw)
    assert [o.type for o in final.output] == ["message"] and final.output_text.strip()
    # The same answer as the whole conversation sent again, without the store.
    again = _create(c, stream, tool_choice="none", input=[
        {"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}], **kw)
    assert again.output_text == final.output_text
    assert again.usage is not None and final.usage is not None
    assert again.usage.input_tokens == final.usage.input_tokens


def _create(c: openai.OpenAI, stream: bool, **kw: Any) -> Any:
    if not stream:
        return c.responses.create(**kw)
    with c.responses.stream(**kw) as s:
        for _ in s:
            pass
        return s.get_final_response()


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_langchain_named_tool_then_answer(server: ServerProcess, api: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return RESULT if city == "Paris" else "unknown city"

    llm = ChatOpenAI(model=_client(server).models.list().data[0].id,
                     base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                     timeout=120, temperature=0, max_tokens=40,
                     use_responses_api=api == "responses")
    messages: list[Any] = [HumanMessage(ASK)]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True).invoke(messages)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
    messages += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert not final.tool_calls and final.text.strip()
