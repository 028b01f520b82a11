"""Agent frameworks nobody here wrote, end to end against kvrelay colocated and 1P1D behind
the proxy (real processes, a tiny random model): LangChain's ``ChatOpenAI.bind_tools``
(over chat completions and over the Responses API) and the OpenAI Agents SDK's
``Runner.run`` (over ``OpenAIChatCompletionsModel`` and ``OpenAIResponsesModel``, tracing
off: no network). Each runs a tool loop: the model calls the tool (forced: a random model
calls only when made to), the framework runs it, its result goes back, a final answer.

"The result reached the model" is checked by the final call's prompt size: it is the
chat template of exactly the conversation with the tool's output in it (``/tokenize``),
with the tools the framework sent (read off its HTTP requests).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest

from kvrelay.testing.models import EOS_ID
from tests.e2e.cluster import Proc, colocated_and_pd

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

WHERE = ["colo", "proxy"]
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}
CITIES = ("Paris", "Oslo")
RESULT = "Sunny and 21 degrees, a light breeze from the west."
ASK = "What is the weather in Paris?"


class Sent:
    """The JSON bodies a framework's HTTP client sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []

    def hook(self, request: httpx.Request) -> None:
        if request.method == "POST":
            self.bodies.append(json.loads(request.content))
            self.paths.append(request.url.path)

    async def ahook(self, request: httpx.Request) -> None:
        self.hook(request)

    def chat_tools(self) -> list[dict[str, Any]]:
        """The last request's tools in chat's shape (the Responses API's are flat)."""
        tools = self.bodies[-1]["tools"]
        return [t if "function" in t else {"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters") if k in t}} for t in tools]


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    from kvrelay.testing.models import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=2048)))
    # The Agents SDK resets tool_choice to auto once a tool ran: the hermes parser serves
    # it (a random model's text holds no <tool_call>: the final answer is text).
    flags = ("--num-blocks", "1024", "--enable-auto-tool-choice", "--tool-call-parser",
             "hermes")
    with colocated_and_pd(model, tmp_path_factory.mktemp("frameworks-logs"), *flags) as (
            _, out):
        yield out


def _model(proc: Proc) -> str:
    return str(httpx.get(proc.url + "/v1/models", timeout=30).json()["data"][0]["id"])


def _prompt_tokens(proc: Proc, messages: list[dict[str, Any]], tools: Any) -> int:
    r = httpx.post(proc.url + "/tokenize", json={"messages": messages, "tools": tools},
                   timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def _loop_turns(call_id: str, arguments: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "content": RESULT}]


# -- LangChain ------------------------------------------------------------------------
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("choice", ["get_weather", "required"])
def test_langchain_bind_tools_loop(procs: dict[str, Proc], where: str, api: str,
                                   choice: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    ran: list[str] = []

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return RESULT

    sent = Sent()
    llm = ChatOpenAI(model=_model(procs[where]), base_url=procs[where].url + "/v1",
                     api_key="none", max_retries=0, timeout=90, temperature=0,
                     max_tokens=60, use_responses_api=api == "responses",
                     http_client=httpx.Client(event_hooks={"request": [sent.hook]}))
    # strict: no properties beyond the schema's (a random model would write some).
    forced = llm.bind_tools([get_weather], tool_choice=choice, parallel_tool_calls=False,
                            strict=True)
    messages: list[Any] = [HumanMessage(ASK)]
    ai = forced.invoke(messages)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in CITIES
    messages += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    assert ran == [call["args"]["city"]]
    final = llm.bind_tools([get_weather], tool_choice="none", strict=True).invoke(messages)
    assert not final.tool_calls and final.text
    assert sent.paths == [PATHS[api]] * 2
    assert final.usage_metadata is not None
    args = json.dumps(call["args"])
    assert final.usage_metadata["input_tokens"] == _prompt_tokens(
        procs["colo"], _loop_turns(call["id"], args), sent.chat_tools())


# -- the OpenAI Agents SDK --------------------------------------------------------------
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("choice", ["get_weather", "required"])
def test_agents_sdk_runner_loop(procs: dict[str, Proc], where: str, api: str,
                                choice: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ran: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return RESULT

    sent = Sent()
    # The Responses API calls a response cut by max_output_tokens a failure (the Agents
    # SDK raises): a strong bias to EOS after one token ends the random model's answer.
    extra = {} if api == "chat" else {"min_tokens": 1, "logit_bias": {str(EOS_ID): 100}}

    async def main() -> Any:
        client = AsyncOpenAI(base_url=procs[where].url + "/v1", api_key="none",
                             max_retries=0, timeout=90, http_client=httpx.AsyncClient(
                                 event_hooks={"request": [sent.ahook]}))
        name = _model(procs[where])
        model: Any = (OpenAIChatCompletionsModel(model=name, openai_client=client)
                      if api == "chat" else OpenAIResponsesModel(model=name,
                                                                 openai_client=client))
        agent = Agent(name="weather", tools=[get_weather], model=model,
                      model_settings=ModelSettings(tool_choice=choice, temperature=0,
                                                   max_tokens=60, parallel_tool_calls=False,
                                                   extra_body=extra))
        try:
            return await Runner.run(agent, ASK, max_turns=3)
        finally:
            await client.close()

    result = asyncio.run(main())
    assert len(ran) == 1 and ran[0] in CITIES
    calls = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert len(calls) == 1 and len(outputs) == 1 and outputs[0].output == RESULT
    raw: Any = calls[0].raw_item
    assert raw.name == "get_weather" and json.loads(raw.arguments) == {"city": ran[0]}
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2  # the call, then the answer: the run finished
    assert sent.paths == [PATHS[api]] * 2
    last = result.raw_responses[-1].usage
    assert last.input_tokens == _prompt_tokens(
        procs["colo"], _loop_turns(raw.call_id, raw.arguments), sent.chat_tools())
