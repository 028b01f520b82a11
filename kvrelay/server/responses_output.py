"""What ``/v1/responses`` answers: output items, the response object, the SSE events of
a stream (OpenAI's sequence, as its SDK accumulates it), and the bounded store behind
``previous_response_id``.

One path for both answers: ``Output`` turns a generation's deltas into events and output
items; a whole answer is the final response of the same run, its events dropped.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvrelay.server.generation import Delta
from kvrelay.wire.http import now
from kvrelay.wire.tools import ContentGate, ToolCall, ToolParser, ToolPlan, call_id

# The store's bounds: fixed here, never sized by what a client sends.
MAX_STORED = 1024
MAX_STORED_BYTES = 64 * 1024 * 1024


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Settings:
    """The request's fields a response object echoes back."""

    model: str
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[Any]
    tool_choice: Any
    parallel_tool_calls: bool
    text: dict[str, Any]
    previous_response_id: str | None
    store: bool
    metadata: dict[str, Any] | None


@dataclass
class _Item:
    """One output item as it grows: a message (text) or a function call."""

    index: int
    kind: str  # "message" | "function_call"
    id: str
    text: str = ""
    name: str = ""
    call_id: str = ""
    done: bool = False
    cut: bool = False  # ended by max_output_tokens before it was whole

    def body(self) -> dict[str, Any]:
        status = ("incomplete" if self.cut else "completed") if self.done else "in_progress"
        if self.kind == "message":
            parts = [_text_part(self.text)] if self.done else []
            return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                    "content": parts}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id,
                "name": self.name, "arguments": self.text if self.done else "",
                "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class Output:
    """A response in the making. ``events`` per delta; ``final`` at the end."""

    rid: str
    settings: Settings
    plan: ToolPlan | None  # None or mode "none": text only
    auto: ToolParser | None
    created_at: int = field(default_factory=now)
    items: list[_Item] = field(default_factory=list)
    seq: int = 0
    _gate: ContentGate | None = None
    _held: list[str] = field(default_factory=list)  # required: the array, read at the end
    status: str = "in_progress"
    incomplete: str | None = None

    def __post_init__(self) -> None:
        if self.mode == "auto":
            assert self.auto is not None
            self._gate = ContentGate(self.auto)

    @property
    def mode(self) -> str:
        return "none" if self.plan is None else self.plan.mode

    # -- events ------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict[str, Any]]:
        out = [self.event("response.created", response=self.body([])),
               self.event("response.in_progress", response=self.body([]))]
        if self.mode == "named":
            assert self.plan is not None and self.plan.name is not None
            out += self._open("function_call", name=self.plan.name)
        return out

    def feed(self, d: Delta) -> list[dict[str, Any]]:
        """The events of one delta (of the only choice)."""
        out: list[dict[str, Any]] = []
        if self.mode == "named":
            out += self._more(self.items[0], d.text)
        elif self.mode == "required":
            self._held.append(d.text)
        elif self._gate is not None:
            out += self._content(self._gate.feed(d.text))
        else:
            out += self._content(d.text)
        if d.finish_reason is not None:
            out += self._finish(d.finish_reason)
        return out

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        out = [] if self.items else self._open("message")
        return out + self._more(self.items[-1], text)

    def _open(self, kind: str, name: str = "") -> list[dict[str, Any]]:
        prefix = "msg" if kind == "message" else "fc"
        item = _Item(len(self.items), kind, item_id(prefix), name=name,
                     call_id=call_id() if kind == "function_call" else "")
        self.items.append(item)
        out = [self.event("response.output_item.added", output_index=item.index,
                          item=item.body())]
        if kind == "message":
            out.append(self.event("response.content_part.added", item_id=item.id,
                                  output_index=item.index, content_index=0,
                                  part=_text_part("")))
        return out

    def _more(self, item: _Item, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        item.text += text
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            return [self.event("response.output_text.delta", content_index=0, delta=text,
                               logprobs=[], **where)]
        return [self.event("response.function_call_arguments.delta", delta=text, **where)]

    def _close(self, item: _Item) -> list[dict[str, Any]]:
        item.done = True
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            out = [self.event("response.output_text.done", content_index=0, text=item.text,
                              logprobs=[], **where),
                   self.event("response.content_part.done", content_index=0,
                              part=_text_part(item.text), **where)]
        else:
            out = [self.event("response.function_call_arguments.done", name=item.name,
                              arguments=item.text, **where)]
        out.append(self.event("response.output_item.done", output_index=item.index,
                              item=item.body()))
        return out

    def _finish(self, reason: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        calls: list[ToolCall] = []
        cut = False  # the last call's arguments end where the output was cut
        if self.mode == "named":
            assert self.plan is not None
            # Streamed as it came; arguments cut by max_output_tokens stay, marked.
            self.items[0].cut = not self.plan.forced(self.items[0].text).whole
        elif self.mode == "required":
            assert self.plan is not None
            text = "".join(self._held)
            forced = self.plan.forced(text)
            calls, cut = list(forced.calls), not forced.whole
            if not calls:
                out += self._content(text)
        elif self._gate is not None:
            rest, calls = self._gate.finish()
            out += self._content(rest)
        if not self.items and not calls:  # nothing came: an empty message, as OpenAI
            out += self._open("message")
        for item in self.items:
            if not item.done:
                item.cut = item.cut or reason == "length"
                out += self._close(item)
        for i, call in enumerate(calls):
            out += self._open("function_call", name=call.name)
            out += self._more(self.items[-1], call.arguments)
            self.items[-1].cut = cut and i == len(calls) - 1  # its arguments as they came
            out += self._close(self.items[-1])
        self.status = "incomplete" if reason == "length" else "completed"
        self.incomplete = "max_output_tokens" if reason == "length" else None
        return out

    def completed(self, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
        return self.event("response.completed", response=self.final(prompt_tokens,
                                                                    output_tokens))

    # -- the response object ---------------------------------------------------------
    def final(self, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
        body = self.body([i.body() for i in self.items])
        body["usage"] = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens,
        }
        return body

    def body(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        s = self.settings
        return {
            "id": self.rid, "object": "response", "created_at": self.created_at,
            "status": self.status, "error": None,
            "incomplete_details": (None if self.incomplete is None
                                   else {"reason": self.incomplete}),
            "instructions": s.instructions, "max_output_tokens": s.max_output_tokens,
            "model": s.model, "output": output, "parallel_tool_calls": s.parallel_tool_calls,
            "previous_response_id": s.previous_response_id, "reasoning": None,
            "store": s.store, "temperature": s.temperature, "text": s.text,
            "tool_choice": s.tool_choice, "tools": s.tools, "top_p": s.top_p,
            "truncation": "disabled", "usage": None, "metadata": s.metadata or {},
        }

    def messages(self) -> list[dict[str, Any]]:
        """The output as chat messages, for a later turn's history."""
        text = "".join(i.text for i in self.items if i.kind == "message")
        calls = [{"id": i.call_id, "type": "function",
                  "function": {"name": i.name, "arguments": i.text}}
                 for i in self.items if i.kind == "function_call"]
        msg: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = calls
        return [msg] if text or calls else []


def sse_event(ev: dict[str, Any]) -> bytes:
    """OpenAI's framing: the event's type on an ``event:`` line, then its data."""
    return f"event: {ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n".encode()


class ResponseStore:
    """The conversations of stored responses (chat messages, without instructions, as
    OpenAI carries them over), for ``previous_response_id``: least recently used out
    first, bounded in count and bytes by the server, never by the request."""

    def __init__(self, max_count: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str) -> list[dict[str, Any]] | None:
        hit = self._items.get(rid)
        if hit is None:
            return None
        self._items.move_to_end(rid)
        return [dict(m) for m in hit[0]]

    def put(self, rid: str, messages: list[dict[str, Any]]) -> bool:
        """Store; False when the conversation alone exceeds the byte bound (not kept)."""
        size = len(json.dumps(messages, ensure_ascii=False).encode())
        if size > self.max_bytes:
            return False
        self._items[rid] = (messages, size)
        self.bytes += size
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            _, (_, gone) = self._items.popitem(last=False)
            self.bytes -= gone
        return True
