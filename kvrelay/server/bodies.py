"""Response bodies: OpenAI JSON for a whole generation, SSE chunks for a stream.

``Shape`` subclasses know the completion and chat layouts; ``collect`` and
``stream_events`` consume a ``Generation``'s deltas. ``EventStream`` ends the stream (and
aborts the generation) as soon as the client goes away.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.server.generation import Delta, Generation
from kvrelay.wire.http import ApiError, now, sse, usage
from kvrelay.wire.openai import LogprobFormatter
from kvrelay.wire.tools import ContentGate, ToolCall, ToolParser, ToolPlan, call_json


# -- response shapes ------------------------------------------------------------------
@dataclass
class Collected:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: list[Any] | None = None


class Shape:
    object_full = ""
    object_chunk = ""

    def __init__(self, rid: str, model: str, with_logprobs: bool, fmt: LogprobFormatter) -> None:
        self.rid, self.model, self.with_logprobs, self.fmt = rid, model, with_logprobs, fmt
        self.created = now()

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, choices: list[Collected], use: dict[str, int]) -> dict[str, Any]:
        body = self.envelope(self.object_full, [self.full_choice(i, c) for i, c in
                                                enumerate(choices)])
        body["usage"] = use
        leases = [c.kv_transfer_params for c in choices if c.kv_transfer_params is not None]
        if leases:  # prefill role (one choice): the lease the decode engine pulls
            body["kv_transfer_params"] = leases[0]
        return body

    def full_choice(self, index: int, c: Collected) -> dict[str, Any]:
        raise NotImplementedError

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    def completion_tokens(self, generated: int) -> int:
        """What usage counts of the tokens the engine generated."""
        return generated

    def chunk(self, d: Delta, offset: int) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(self, d: Delta, offset: int) -> list[dict[str, Any]]:
        """The SSE chunks of one delta (a shape that holds text back may send none)."""
        return [self.chunk(d, offset)]


class CompletionShape(Shape):
    object_full = object_chunk = "text_completion"

    def __init__(self, rid: str, model: str, with_logprobs: bool, fmt: LogprobFormatter) -> None:
        super().__init__(rid, model, with_logprobs, fmt)
        # Streams: per choice, the text offset of its next token, advanced by the token
        # texts reported (as vLLM does, and as a whole answer counts them), not by the
        # text sent: a token that ends inside a character has a text, the stream not yet.
        self._next: dict[int, int] = {}

    def full_choice(self, index: int, c: Collected) -> dict[str, Any]:
        lp = self.fmt.completion(c.token_ids, c.logprobs, 0) if self._has_lp(c) else None
        return {"index": index, "text": "".join(c.text), "logprobs": lp,
                "finish_reason": c.finish_reason}

    def chunk(self, d: Delta, offset: int) -> dict[str, Any]:
        lp = None
        start = self._next.get(d.index, 0)
        if self.with_logprobs and d.logprobs is not None:
            lp = self.fmt.completion(d.token_ids, d.logprobs, start)
        if self.with_logprobs:  # offsets are logprobs' only
            self._advance(d.index, start, d.token_ids)
        return self.envelope(self.object_chunk, [
            {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        ])

    def _advance(self, index: int, start: int, token_ids: Sequence[int]) -> None:
        """Also by tokens sent without logprobs (a decode engine's token 1, when the
        proxy in front did not send it)."""
        self._next[index] = start + sum(len(self.fmt.token_text(t)) for t in token_ids)

    def _has_lp(self, c: Collected) -> bool:
        return self.with_logprobs and len(c.logprobs) == len(c.token_ids)


@dataclass
class Echo:
    """What a completion with echo or prompt_logprobs reports of its prompts."""

    prompts: list[tuple[list[int], str]]  # per prompt: its token ids and its text
    n: int  # choices per prompt
    echo: bool
    only: bool  # max_tokens 0: the engine's one token is not part of the answer
    prompt_logprobs: bool  # vLLM's prompt_logprobs field


class EchoShape(CompletionShape):
    """Completions with echo (the prompt before the output; with logprobs, the prompt
    tokens' logprobs first) and vLLM's prompt_logprobs."""

    def __init__(self, rid: str, model: str, with_logprobs: bool, fmt: LogprobFormatter,
                 echo: Echo) -> None:
        super().__init__(rid, model, with_logprobs, fmt)
        self.e = echo
        self._echoed: set[int] = set()  # streams: the choices whose prompt went out

    def completion_tokens(self, generated: int) -> int:
        return 0 if self.e.only else generated

    def full_choice(self, index: int, c: Collected) -> dict[str, Any]:
        ids, text = self.e.prompts[index // self.e.n]
        prompt_lps = c.prompt_logprobs
        if self.e.only:
            c = Collected(finish_reason="length")
        out = super().full_choice(index, c)
        if not self.e.echo:
            out["prompt_logprobs"] = self._prompt_lps(ids, prompt_lps)
            return out
        out["text"] = text + out["text"]
        if self.with_logprobs:
            if prompt_lps is None or len(prompt_lps) != len(ids) - 1:
                raise ApiError(500, "the engine computed no prompt logprobs",
                               type="server_error")
            output = out["logprobs"]
            if output is not None:  # output offsets continue after the prompt's tokens
                shift = sum(len(self.fmt.token_text(t)) for t in ids)
                output = dict(output, text_offset=[o + shift for o in output["text_offset"]])
            out["logprobs"] = self.fmt.echoed(ids, prompt_lps, output)
        if self.e.prompt_logprobs:
            out["prompt_logprobs"] = self._prompt_lps(ids, prompt_lps)
        return out

    def chunk(self, d: Delta, offset: int) -> dict[str, Any]:
        """As vLLM streams echo: a choice's first chunk holds the prompt's text (and with
        logprobs its tokens', the first one's null) before its first token's; with
        max_tokens 0 the prompt alone. Text offsets go on from the prompt's tokens."""
        first = d.index not in self._echoed
        self._echoed.add(d.index)
        if first and self.e.echo:
            ids, text = self.e.prompts[d.index // self.e.n]
            if self.e.only:
                d = Delta(d.index, "", [], [], "length", prompt_logprobs=d.prompt_logprobs)
            lp = None
            if self.with_logprobs:
                if d.prompt_logprobs is None or len(d.prompt_logprobs) != len(ids) - 1:
                    raise ApiError(500, "the engine computed no prompt logprobs",
                                   type="server_error")
                shift = sum(len(self.fmt.token_text(t)) for t in ids)
                output = self.fmt.completion(d.token_ids, d.logprobs or [], shift)
                lp = self.fmt.echoed(ids, d.prompt_logprobs, output)
                self._advance(d.index, shift, d.token_ids)
            return self.envelope(self.object_chunk, [
                {"index": d.index, "text": text + d.text, "logprobs": lp,
                 "finish_reason": d.finish_reason}])
        if self.e.only:  # nothing follows the prompt's chunk
            return self.envelope(self.object_chunk, [])
        return super().chunk(d, offset)

    def chunks(self, d: Delta, offset: int) -> list[dict[str, Any]]:
        chunk = self.chunk(d, offset)
        return [chunk] if chunk["choices"] else []

    def _prompt_lps(self, ids: list[int], lps: list[Any] | None) -> list[Any]:
        if lps is None or len(lps) != len(ids) - 1:
            raise ApiError(500, "the engine computed no prompt logprobs", type="server_error")
        return self.fmt.prompt_logprobs(ids, lps)


class ChatShape(Shape):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    # vLLM's prompt_logprobs (top level: a chat request has one prompt): its token ids.
    prompt_ids: list[int] | None = None

    def full(self, choices: list[Collected], use: dict[str, int]) -> dict[str, Any]:
        body = super().full(choices, use)
        if self.prompt_ids is not None:
            lps = choices[0].prompt_logprobs
            if lps is None or len(lps) != len(self.prompt_ids) - 1:
                raise ApiError(500, "the engine computed no prompt logprobs",
                               type="server_error")
            body["prompt_logprobs"] = self.fmt.prompt_logprobs(self.prompt_ids, lps)
        return body

    def full_choice(self, index: int, c: Collected) -> dict[str, Any]:
        has_lp = self.with_logprobs and len(c.logprobs) == len(c.token_ids)
        return {
            "index": index,
            "message": {"role": "assistant", "content": "".join(c.text)},
            "logprobs": self.fmt.chat(c.token_ids, c.logprobs) if has_lp else None,
            "finish_reason": c.finish_reason,
        }

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return [
            self.envelope(self.object_chunk, [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}
            ])
            for i in range(num_choices)
        ]

    def chunk(self, d: Delta, offset: int) -> dict[str, Any]:
        lp = None
        if self.with_logprobs and d.logprobs is not None:
            lp = self.fmt.chat(d.token_ids, d.logprobs)
        delta = {"content": d.text} if d.text or d.finish_reason is None else {}
        return self.envelope(self.object_chunk, [
            {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}
        ])


class ToolChatShape(ChatShape):
    """Chat with tools: calls as ``message.tool_calls`` and ``delta.tool_calls``.

    Named function: the output is the arguments, streamed as they come (the first delta
    carries id, type and name). ``required``: the output is a JSON array of calls, sent
    whole at the end. ``auto``: content streams until the parser's marker; the calls
    after it are sent at the end (as vLLM, the text stays content when they do not parse).
    A forced call cut by max_tokens is still a call, its arguments partial and the finish
    ``length`` (``ToolPlan.forced``): a client that forced a tool reads ``tool_calls``.
    """

    def __init__(self, rid: str, model: str, with_logprobs: bool, fmt: LogprobFormatter,
                 plan: ToolPlan, auto: ToolParser | None) -> None:
        super().__init__(rid, model, with_logprobs, fmt)
        self.plan, self.auto = plan, auto
        self._gates: dict[int, ContentGate] = {}
        self._text: dict[int, list[str]] = {}
        self._named_started: set[int] = set()

    def _calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.plan.mode == "auto":
            assert self.auto is not None
            return self.auto.extract(text)
        calls = list(self.plan.forced(text).calls)
        return (text, []) if not calls else (None, calls)

    def full_choice(self, index: int, c: Collected) -> dict[str, Any]:
        out = super().full_choice(index, c)
        content, calls = self._calls("".join(c.text))
        if calls:
            out["message"] = {"role": "assistant", "content": content,
                              "tool_calls": [call_json(t) for t in calls]}
            if c.finish_reason == "stop":
                out["finish_reason"] = "tool_calls"
        return out

    def chunks(self, d: Delta, offset: int) -> list[dict[str, Any]]:
        if self.plan.mode == "named":
            return self._named(d)
        if self.plan.mode == "auto":
            assert self.auto is not None
            gate = self._gates.setdefault(d.index, ContentGate(self.auto))
            content = gate.feed(d.text)
            calls: list[ToolCall] = []
            if d.finish_reason is not None:
                rest, calls = gate.finish()
                content += rest
        else:  # required: the array is read whole at the end
            self._text.setdefault(d.index, []).append(d.text)
            content, calls = "", []
            if d.finish_reason is not None:
                text = "".join(self._text.pop(d.index))
                calls = list(self.plan.forced(text).calls)
                content = "" if calls else text
        out = []
        if content or d.logprobs:
            out.append(self._piece(d, {"content": content} if content else {}))
        if calls:
            out.append(self._piece(d, {"tool_calls": [call_json(t, i)
                                                      for i, t in enumerate(calls)]},
                                   logprobs=False))
        if d.finish_reason is not None:
            reason = "tool_calls" if calls and d.finish_reason == "stop" else d.finish_reason
            out.append(self._piece(d, {}, reason, logprobs=False))
        return out

    def _named(self, d: Delta) -> list[dict[str, Any]]:
        out = []
        if d.index not in self._named_started:
            self._named_started.add(d.index)
            assert self.plan.name is not None
            first = call_json(ToolCall(self.plan.name, ""), 0)
            out.append(self._piece(d, {"tool_calls": [first]}, logprobs=False))
        if d.text or d.logprobs:
            args = {"tool_calls": [{"index": 0, "function": {"arguments": d.text}}]}
            out.append(self._piece(d, args if d.text else {}))
        if d.finish_reason is not None:
            reason = "tool_calls" if d.finish_reason == "stop" else d.finish_reason
            out.append(self._piece(d, {}, reason, logprobs=False))
        return out

    def _piece(self, d: Delta, delta: dict[str, Any], finish: str | None = None,
               logprobs: bool = True) -> dict[str, Any]:
        lp = None
        if logprobs and self.with_logprobs and d.logprobs is not None:
            lp = self.fmt.chat(d.token_ids, d.logprobs)
        return self.envelope(self.object_chunk, [
            {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        ])


# -- collecting and streaming ---------------------------------------------------------
async def collect(gen: Generation, num_choices: int) -> list[Collected]:
    out = [Collected() for _ in range(num_choices)]
    async for d in gen.deltas():
        c = out[d.index]
        c.text.append(d.text)
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            c.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            c.prompt_logprobs = d.prompt_logprobs
        if d.finish_reason is not None:
            c.finish_reason = d.finish_reason
            c.kv_transfer_params = d.kv_transfer_params
    return out


async def stream_events(
    gen: Generation, shape: Shape, include_usage: bool, num_choices: int
) -> AsyncIterator[bytes]:
    offsets = [0] * num_choices
    try:
        for chunk in shape.first_chunks(num_choices):
            yield sse(_with_usage(chunk, include_usage))
        async for d in gen.deltas():
            for chunk in shape.chunks(d, offsets[d.index]):
                yield sse(_with_usage(chunk, include_usage))
            offsets[d.index] += len(d.text)
        if include_usage:
            final = shape.envelope(shape.object_chunk, [])
            final["usage"] = usage(gen.prompt_tokens,
                                   shape.completion_tokens(gen.completion_tokens))
            yield sse(final)
    except ApiError as exc:
        yield sse(exc.body())
    finally:
        gen.abort_unfinished()
    yield sse("[DONE]")


def _with_usage(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    if include_usage:
        chunk["usage"] = None
    return chunk


