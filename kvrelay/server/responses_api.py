"""``POST /v1/responses``: OpenAI's Responses API, as vLLM serves it.

A request becomes a chat request (``to_chat``): ``instructions`` a system message, the
``input`` (text, or messages and ``function_call``/``function_call_output`` items) chat
turns, Responses-shaped function tools chat-shaped ones, ``text.format`` a
``response_format``. From there it is the chat route's path: the same validation, chat
template, tool plan (grammar-forced ``required``/named calls, the ``--tool-call-parser``
for ``auto``) and generation. ``responses_output.Output`` lays out the answer.

``previous_response_id`` prepends a stored response's conversation (its input and output,
without its instructions, as OpenAI). The store is per engine, bounded (MAX_STORED,
MAX_STORED_BYTES), least recently used out first; ``store: false`` keeps nothing.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, ClassVar, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvrelay.server.generation import ChoiceSpec, Generation
from kvrelay.server.responses_output import Output, ResponseStore, Settings, sse_event
from kvrelay.wire.http import ApiError, bad_request, load_json, new_id, read_body, validate
from kvrelay.wire.openai import ChatCompletionRequest, _Strict
from kvrelay.wire.sse import EventStream, until_disconnect
from kvrelay.wire.tools import parser


class _ToolSettings(Protocol):
    @property
    def tool_parser(self) -> str | None: ...


class ChatHandlers(Protocol):
    """What this route uses of the chat route's handlers (kvrelay.server.api): a
    Responses request is served as the chat request it becomes."""

    @property
    def state(self) -> _ToolSettings: ...
    def _check_auth(self, request: Request) -> None: ...
    def _check_model(self, name: str) -> None: ...
    def _render_chat(self, body: ChatCompletionRequest) -> list[int]: ...
    def _specs(self, body: Any, prompts: Sequence[list[int]], max_tokens: int | None,
               logprobs: int | None) -> list[ChoiceSpec]: ...
    def _check_extras(self, specs: Sequence[ChoiceSpec]) -> None: ...
    def _generation(self, prefix: str, param_names: dict[str, str], arrival: float,
                    kv_params: dict[str, Any] | None = None) -> Generation: ...

MAX_INPUT_ITEMS = 4096
# Passed to the chat request as they are: OpenAI's temperature and top_p, vLLM's extras.
SAMPLING = ("temperature", "top_p", "seed", "top_k", "min_p", "stop", "stop_token_ids",
            "ignore_eos", "include_stop_str_in_output", "logit_bias", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "min_tokens", "bad_words",
            "allowed_token_ids")
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_Rule = tuple[Callable[[Any], bool], str]


class ResponsesRequest(_Strict):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    # vLLM's extra sampling parameters (as on chat; validated there).
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None

    # OpenAI's fields that change the answer and that kvrelay does not serve: a 400 naming
    # them unless sent with the value meaning "off".
    REFUSED: ClassVar[dict[str, _Rule]] = {
        "background": (lambda v: not v, "background responses are not supported"),
        "conversation": (lambda v: v is None, "conversations are not supported: use "
                         "previous_response_id"),
        "prompt": (lambda v: v is None, "prompt templates are not supported"),
        "include": (lambda v: not v, "include is not supported (no extra output data)"),
        "reasoning": (lambda v: not v or not any(v.values()) if isinstance(v, dict)
                      else v is None, "reasoning is not supported"),
        "top_logprobs": (lambda v: not v, "top_logprobs is not supported"),
        "truncation": (lambda v: v in (None, "disabled"), "truncation \"auto\" is not "
                       "supported: a prompt longer than the context is refused"),
        "max_tool_calls": (lambda v: v is None, "max_tool_calls is not supported"),
        "context_management": (lambda v: not v, "context_management is not supported"),
        "stream_options": (lambda v: not v or not any(v.values()) if isinstance(v, dict)
                           else v is None, "stream_options is not supported"),
    }
    HARMLESS: ClassVar[frozenset[str]] = frozenset({
        "user", "service_tier", "safety_identifier", "prompt_cache_key",
        "prompt_cache_retention", "prompt_cache_options", "request_id",
    })


# -- translation ------------------------------------------------------------------------
def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[
        dict[str, Any], list[dict[str, Any]]]:
    """(the chat request's body, this turn's input as chat messages)."""
    turn = input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": req.model, "messages": [*system, *history, *turn]}
    for key, value in (("max_tokens", req.max_output_tokens),
                       ("parallel_tool_calls", req.parallel_tool_calls)):
        if value is not None:
            body[key] = value
    for key in SAMPLING:
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if req.tools:
        body["tools"] = [chat_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    fmt = text_format(req.text)
    if fmt is not None:
        body["response_format"] = fmt
    return body, turn


def input_messages(given: str | list[Any]) -> list[dict[str, Any]]:
    """``input`` as chat messages; a run of function_call items is one assistant turn."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not given:
        raise bad_request("input", "input must not be empty")
    if len(given) > MAX_INPUT_ITEMS:
        raise bad_request("input", f"at most {MAX_INPUT_ITEMS} input items are allowed, got "
                          f"{len(given)}")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(where, f"{where} must be an object (a message or an item)")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(where, item))
        elif kind == "function_call":
            call = _function_call(where, item)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(where, item, "call_id"),
                        "content": _output_text(where, item.get("output"))})
        else:
            raise bad_request(f"{where}.type", f"{where}.type {kind!r} is not supported: "
                              "message, function_call and function_call_output are")
    return out


def _string(where: str, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}", f"{where}.{key} must be a string")
    return value


def _message(where: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role", f"{where}.role must be one of {', '.join(_ROLES)}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{where}.content", f"{where}.content must be text or a list of "
                          "text parts")
    return {"role": role, "content": _parts_text(f"{where}.content", content)}


def _parts_text(where: str, parts: list[Any]) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]", f"{where}[{j}] must be a text part "
                              f"({', '.join(_TEXT_PARTS)}); got type {kind!r} (only text "
                              "input is supported)")
        texts.append(part["text"])
    return "".join(texts)


def _function_call(where: str, item: dict[str, Any]) -> dict[str, Any]:
    return {"id": _string(where, item, "call_id"), "type": "function",
            "function": {"name": _string(where, item, "name"),
                         "arguments": _string(where, item, "arguments")}}


def _output_text(where: str, output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _parts_text(f"{where}.output", output)
    raise bad_request(f"{where}.output", f"{where}.output must be text or a list of text parts")


def chat_tool(i: int, tool: Any) -> dict[str, Any]:
    """A Responses function tool ({type, name, description, parameters, strict}) as chat
    takes it; every other tool type (hosted tools) is a 400."""
    where = f"tools[{i}]"
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise bad_request(f"{where}.type", f"{where}.type must be \"function\" (hosted "
                          f"tools are not supported), got {kind!r}")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict):
        raise bad_request("tool_choice", "tool_choice must be \"none\", \"auto\", "
                          "\"required\" or {\"type\": \"function\", \"name\": ...}")
    return choice


def text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise bad_request("text.format.type", "text.format.type must be text, json_object or "
                      f"json_schema, got {kind!r}")


# Chat's names for the fields whose errors the client must see under Responses' names.
_RENAMES = (("response_format.json_schema.", "text.format."),
            ("response_format", "text.format"), ("max_tokens", "max_output_tokens"),
            ("tool_choice.function.name", "tool_choice.name"), ("messages", "input"))


def renamed(exc: ApiError) -> ApiError:
    """A chat validation error, its param (and message) in the Responses API's names."""
    param, message = exc.param or "", exc.message
    for chat, ours in _RENAMES:
        if param.startswith(chat):
            param = ours + param[len(chat):]
            break
    for chat, ours in _RENAMES[1:3]:  # names no other word contains
        message = message.replace(chat, ours)
    if param.startswith("tools[") and ".function." in param:
        message = message.replace(param, param.replace(".function.", "."))
        param = param.replace(".function.", ".")
    return ApiError(exc.status, message, param=param or None, type=exc.type, code=exc.code)


def settings(req: ResponsesRequest, chat: ChatCompletionRequest) -> Settings:
    return Settings(
        model=req.model, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        temperature=chat.temperature, top_p=chat.top_p, tools=list(req.tools or []),
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False,
        text=req.text if req.text and req.text.get("format") else {"format": {"type": "text"}},
        previous_response_id=req.previous_response_id, store=req.store,
        metadata=req.metadata)


# -- the route ----------------------------------------------------------------------------
class ResponsesRoute:
    """``POST /v1/responses`` on an engine; shares the chat route's helpers."""

    def __init__(self, handlers: ChatHandlers, store: ResponseStore | None = None) -> None:
        self.h = handlers
        self.store = store if store is not None else ResponseStore()

    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        h = self.h
        h._check_auth(request)
        req = validate(load_json(await read_body(request)), ResponsesRequest)
        h._check_model(req.model)
        history = self._history(req.previous_response_id)
        chat_body, turn = to_chat(req, history)
        try:
            chat = validate(chat_body, ChatCompletionRequest)
            chat.check()
        except ApiError as exc:
            raise renamed(exc) from exc
        plan = chat.tool_plan
        if plan is not None and plan.mode == "auto" and h.state.tool_parser is None:
            raise bad_request("tool_choice", "\"auto\" tool choice requires "
                              "--enable-auto-tool-choice and --tool-call-parser to be set "
                              "(tool_choice defaults to auto when tools are sent)")
        try:
            prompt = h._render_chat(chat)
            specs = h._specs(chat, [prompt], chat.requested_max_tokens(), None)
            h._check_extras(specs)
        except ApiError as exc:
            raise renamed(exc) from exc
        gen = h._generation("resp", {"prompt": "input"}, arrival)
        await gen.start(specs, len(prompt))
        auto = parser(h.state.tool_parser) if h.state.tool_parser else None
        out = Output(new_id("resp").replace("-", "_"), settings(req, chat),
                     plan if plan is not None and plan.mode != "none" else None, auto)
        keep = [*history, *turn] if req.store else None
        if req.stream:
            return EventStream(self._events(gen, out, keep), on_close=gen.abort_unfinished)
        try:
            done = await until_disconnect(request, self._run(gen, out))
        finally:
            gen.abort_unfinished()
        if done is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        self._keep(out, keep)
        return JSONResponse(out.final(gen.prompt_tokens, gen.completion_tokens))

    def _history(self, rid: str | None) -> list[dict[str, Any]]:
        if rid is None:
            return []
        found = self.store.get(rid)
        if found is None:
            # OpenAI's answer: 400, naming the field.
            raise bad_request("previous_response_id", f"Previous response with id {rid[:80]!r} "
                              "not found (this engine stores the last responses made with "
                              "store: true, up to a bound)")
        return found

    def _keep(self, out: Output, keep: list[dict[str, Any]] | None) -> None:
        if keep is not None:
            self.store.put(out.rid, keep + out.messages())

    async def _run(self, gen: Any, out: Output) -> bool:
        out.start()
        async for d in gen.deltas():
            out.feed(d)
        return True

    async def _events(self, gen: Any, out: Output, keep: list[dict[str, Any]] | None
                      ) -> AsyncIterator[bytes]:
        try:
            for ev in out.start():
                yield sse_event(ev)
            async for d in gen.deltas():
                for ev in out.feed(d):
                    yield sse_event(ev)
            self._keep(out, keep)
            yield sse_event(out.completed(gen.prompt_tokens, gen.completion_tokens))
        except ApiError as exc:
            yield sse_event(out.event("error", code=exc.code or exc.type,
                                      message=exc.message, param=exc.param))
        finally:
            gen.abort_unfinished()
