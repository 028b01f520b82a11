"""Tool calling: the request's tools and tool_choice, the grammar that forces a call,
the parsers that find calls in free text, and the OpenAI layout of the calls.

As vLLM: ``required`` and a named function are forced by the grammar engine (the output
is a JSON array of ``{"name", "parameters"}`` for ``required``, the function's arguments
object for a named one); ``auto`` lets the model write and a parser of its family
(``--tool-call-parser``) finds the calls in the text; ``none`` generates plain text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvrelay.sampling_params import InvalidParameter, StructuredOutput
from kvrelay.wire.schema import compile_grammar

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """One entry of ``message.tool_calls`` (with ``index``: of ``delta.tool_calls``)."""
    out: dict[str, Any] = {"id": call_id(), "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class Forced:
    """What a forced output holds: its calls (none when not even a name came) and whether
    it is whole JSON (else the last call's arguments may be cut)."""

    calls: tuple[ToolCall, ...]
    whole: bool


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools, validated. ``mode``: none, auto, required or
    named (then ``name`` is the function)."""

    mode: str
    tools: tuple[dict[str, Any], ...]  # the request's tools, as sent (for the template)
    schemas: dict[str, dict[str, Any]]  # function name -> its parameters' JSON Schema
    parallel: bool
    name: str | None = None

    def structured(self) -> StructuredOutput | None:
        """The grammar that forces the call(s): None unless required or named."""
        if self.mode == "named":
            assert self.name is not None
            schema: dict[str, Any] = self.schemas[self.name]
        elif self.mode == "required":
            schema = {
                "type": "array", "minItems": 1,
                "items": {"anyOf": [
                    {"type": "object", "properties": {"name": {"enum": [n]}, "parameters": s},
                     "required": ["name", "parameters"], "additionalProperties": False}
                    for n, s in self.schemas.items()
                ]},
            }
            if not self.parallel:
                schema["maxItems"] = 1
        else:
            return None
        text = json.dumps(schema)
        try:
            return StructuredOutput("json_schema", text, compile_grammar(text))
        except InvalidParameter as exc:
            raise InvalidParameter("tools", f"the tools' schemas cannot be enforced: {exc}") \
                from exc

    def forced(self, text: str) -> Forced:
        """The calls in a grammar-forced output, whole or cut (by max_tokens or a stop
        string). As vLLM: a named choice's output is its call's arguments whatever they
        hold; a ``required`` array cut short gives its whole elements and, once its name
        is whole, the element it was cut in, its arguments as far as they came (as vLLM
        streams them)."""
        if self.mode == "named":
            assert self.name is not None
            calls = (ToolCall(self.name, text),) if text.strip() else ()
            return Forced(calls, _parses(text))
        try:
            doc = json.loads(text)
        except ValueError:
            return Forced(tuple(_cut_array(text)), False)
        if not isinstance(doc, list):
            return Forced((), False)
        return Forced(tuple(ToolCall(str(c["name"]), _args(c["parameters"])) for c in doc
                            if isinstance(c, dict) and "name" in c and "parameters" in c),
                      True)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _args(params: Any) -> str:
    return json.dumps(params, ensure_ascii=False)


# One element of a required array up to its arguments: name first, as the grammar writes
# the properties in the schema's order; a name as plan_tools allows them (_NAME).
_ELEMENT_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"\s*,\s*'
                           r'"parameters"\s*:\s*')


def _cut_array(text: str) -> list[ToolCall]:
    """The calls of a ``required`` array that does not parse: the elements before the
    cut, then the one cut, with the arguments it has (none yet: ``""``)."""
    dec = json.JSONDecoder()
    out: list[ToolCall] = []
    i = text.find("[") + 1
    if i == 0 or text[:i - 1].strip():
        return []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            doc, i = dec.raw_decode(text, i)
        except ValueError:
            break
        if not isinstance(doc, dict) or "name" not in doc or "parameters" not in doc:
            return out
        out.append(ToolCall(str(doc["name"]), _args(doc["parameters"])))
    head = _ELEMENT_HEAD.match(text, i)
    if head is not None:
        rest = text[head.end():]
        out.append(ToolCall(head.group(1), _args(json.loads(rest)) if _parses(rest) else rest))
    return out


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None
               ) -> ToolPlan | None:
    """The request's tools and tool_choice, checked (InvalidParameter names the field);
    None when there are no tools and tool_choice asks for none. tool_choice defaults to
    auto when tools are sent (OpenAI's and vLLM's default)."""
    if not tools:
        if tool_choice is None or tool_choice == "none":
            return None
        raise InvalidParameter("tool_choice", "tool_choice other than \"none\" needs tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidParameter("tools", f"at most {MAX_TOOLS} tools are allowed, got "
                               f"{len(tools)}")
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        name, schema = _check_tool(i, tool)
        if name in schemas:
            raise InvalidParameter(f"tools[{i}].function.name",
                                   f"two tools are named {name!r}")
        schemas[name] = schema
    mode, named = _choice(tool_choice if tool_choice is not None else "auto", schemas)
    return ToolPlan(mode, tuple(tools), schemas, True if parallel is None else parallel, named)


def _check_tool(i: int, tool: Any) -> tuple[str, dict[str, Any]]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidParameter(f"{where}.type", f"{where}.type must be \"function\"")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise InvalidParameter(f"{where}.function", f"{where}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidParameter(f"{where}.function.name", f"{where}.function.name must be 1 "
                               "to 64 letters, digits, '_', '.' or '-'")
    if not isinstance(fn.get("description", ""), str):
        raise InvalidParameter(f"{where}.function.description",
                               f"{where}.function.description must be a string")
    params = fn.get("parameters", _EMPTY_PARAMS)
    if not isinstance(params, dict):
        raise InvalidParameter(f"{where}.function.parameters",
                               f"{where}.function.parameters must be a JSON Schema object")
    try:
        compile_grammar(json.dumps(params))
    except InvalidParameter as exc:
        raise InvalidParameter(f"{where}.function.parameters", f"{where}.function.parameters: "
                               f"{exc}") from exc
    return name, params


def _choice(choice: Any, schemas: dict[str, dict[str, Any]]) -> tuple[str, str | None]:
    if choice in ("none", "auto", "required"):
        return str(choice), None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(
            name, str):
        raise InvalidParameter("tool_choice", "tool_choice must be \"none\", \"auto\", "
                               "\"required\" or {\"type\": \"function\", \"function\": "
                               "{\"name\": ...}}")
    if name not in schemas:
        raise InvalidParameter("tool_choice.function.name", f"tool_choice names {name!r}, "
                               f"which is not among the tools ({', '.join(schemas)})")
    return "named", name


# -- parsers of free text (tool_choice auto) ------------------------------------------
class ToolParser:
    """Finds a model family's tool calls in its text. ``marker``: where calls begin
    (text before it is content); ``at_start``: only at the start of the text."""

    marker = ""
    at_start = False

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls); no calls when the text holds none or they do not parse (the
        whole text is then content, as vLLM)."""
        start = self.find(text)
        if start is None:
            return text, []
        try:
            calls = self.calls(text[start:])
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def find(self, text: str) -> int | None:
        if self.at_start:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(self.marker) else None
        i = text.find(self.marker)
        return None if i < 0 else i

    def calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError


def _call(doc: Any, args_key: str = "arguments") -> ToolCall:
    args = doc.get(args_key, doc.get("parameters", doc.get("arguments", {})))
    if not isinstance(doc["name"], str) or not isinstance(args, dict):
        raise ValueError("not a tool call")
    return ToolCall(doc["name"], json.dumps(args, ensure_ascii=False))


class HermesParser(ToolParser):
    """Hermes, Qwen2.5, SmolLM2-style: ``<tool_call>{"name", "arguments"}</tool_call>``."""

    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def calls(self, text: str) -> list[ToolCall]:
        return [_call(json.loads(m)) for m in self._block.findall(text)]


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON calls: ``{"name", "parameters"}`` objects, ``;``-separated, the
    text starting with one (``<|python_tag|>`` is a special token: skipped in the text)."""

    marker = "{"
    at_start = True

    def calls(self, text: str) -> list[ToolCall]:
        dec, i = json.JSONDecoder(), 0
        out: list[ToolCall] = []
        while True:
            while i < len(text) and text[i] in " \t\r\n;":
                i += 1
            if i == len(text):
                return out
            doc, i = dec.raw_decode(text, i)
            out.append(_call(doc, "parameters"))


class MistralParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name", "arguments"}, ...]``."""

    marker = "[TOOL_CALLS]"

    def calls(self, text: str) -> list[ToolCall]:
        doc, _ = json.JSONDecoder().raw_decode(text[len(self.marker):].lstrip())
        docs = doc if isinstance(doc, list) else [doc]
        return [_call(d) for d in docs]


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def parser(name: str) -> ToolParser:
    return PARSERS[name]()


class ContentGate:
    """Streaming ``auto``: passes content through until the parser's marker shows up,
    then holds the rest back for ``extract`` at the end. A tail that may be the start of
    the marker is held until the next text tells."""

    def __init__(self, p: ToolParser) -> None:
        self.p = p
        self.text = ""  # all the text so far
        self.sent = 0  # characters of it sent as content
        self.calling = False

    def feed(self, text: str) -> str:
        """The content to send now."""
        self.text += text
        if self.calling:
            return ""
        start = self.p.find(self.text)
        if start is not None:
            self.calling = True
            return self._send(start)
        if self.p.at_start:
            # Calls only at the start: once text other than whitespace came, it is content.
            return self._send(len(self.text) if self.text.strip() else self.sent)
        return self._send(len(self.text) - _marker_prefix(self.text, self.p.marker))

    def _send(self, upto: int) -> str:
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still to send, calls) at the end of the choice."""
        if not self.calling:
            return self.text[self.sent:], []
        _, calls = self.p.extract(self.text)  # the content before the marker went out
        if not calls:
            return self.text[self.sent:], []
        return "", calls


def _marker_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def describe_tools(tools: tuple[dict[str, Any], ...]) -> str:
    """The system text that tells a model whose template ignores ``tools`` about them,
    in the Hermes format (the hermes parser's): as vLLM's hermes templates and Qwen2.5
    say it."""
    specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query."
            "\n\nYou are provided with function signatures within <tools></tools> XML tags:"
            f"\n<tools>\n{specs}\n</tools>\n\nFor each function call, return a json object "
            "with function name and arguments within <tool_call></tool_call> XML tags:\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
            "</tool_call>")


def hermes_calls_text(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant turn's earlier calls as Hermes text, for templates that ignore
    ``tool_calls``."""
    parts = []
    for c in tool_calls:
        fn = c.get("function") or {}
        args = fn.get("arguments", "{}")
        try:
            args_doc = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args_doc = args
        parts.append("<tool_call>\n" + json.dumps({"name": fn.get("name"),
                                                   "arguments": args_doc},
                                                  ensure_ascii=False) + "\n</tool_call>")
    return "\n".join(parts)
