"""How the proxy answers like one server although each choice ran on its own P/D pair.

A client request is split into legs, one per prompt of a batch and per choice (``n``):
each leg is a one-prompt, ``n=1`` request (choice j samples with ``seed + j``, as a
colocated engine does). A leg's answer is P's first token followed by D's tokens 2..n
(or P's answer alone when the first token ended it, or a whole colocated answer from D
when no prefill engine answered or the prefill was placed on D). This module turns
legs' answers into one OpenAI response: one id, one ``created`` and ``model``, each
choice under its index, for chat one role per choice, logprobs covering every token
(P's first one included) and usage counting each prompt once.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvrelay.proxy.legs import Leg


@dataclass
class Frame:
    """The envelope every chunk and body of one client request carries."""

    chat: bool
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    model: str | None = None

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    @property
    def object_chunk(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @property
    def object_full(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def saw(self, upstream: dict[str, Any]) -> None:
        """The served model's name, as the first engine that answered reports it."""
        if self.model is None and upstream.get("model"):
            self.model = str(upstream["model"])


def total_usage(legs: list[Leg]) -> dict[str, int]:
    """Each prompt counted once (as a colocated engine does for ``n`` > 1), every
    choice's completion tokens."""
    prompt = sum(leg.usage["prompt_tokens"] for leg in legs if leg.usage and leg.counts_prompt)
    completion = sum(leg.usage["completion_tokens"] for leg in legs if leg.usage)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def text_of(choice: dict[str, Any]) -> str:
    if "message" in choice:
        return str(choice["message"].get("content") or "")
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return str(choice.get("text") or "")


def _finish_of(choice: dict[str, Any]) -> Any:
    finish = choice.get("finish_reason")
    return "length" if finish == "remote_decode" else finish  # the client asked for 1


# -- whole answers ---------------------------------------------------------------------
def leg_choice(leg: Leg, decoded: dict[str, Any] | None) -> dict[str, Any]:
    """A leg's choice from P's answer and D's (``decoded``; None when P's answer is the
    whole of it). A colocated leg has no P answer: D's choice as it is."""
    leg.prompt_logprobs = (leg.first or decoded or {}).get("prompt_logprobs")
    if leg.first is None:
        assert decoded is not None
        leg.usage = decoded.get("usage")
        return dict(decoded["choices"][0], index=leg.index)
    p = leg.first["choices"][0]
    if decoded is None:
        leg.usage = leg.first.get("usage")
        return dict(p, index=leg.index, finish_reason=_finish_of(p))
    d = decoded["choices"][0]
    leg.usage = decoded.get("usage")
    out = dict(d, index=leg.index)
    if leg.resends or leg.tools is not None:  # D's choice starts with token 1 itself
        return out
    text = text_of(p) + text_of(d)
    if "message" in d:
        out["message"] = dict(d["message"], content=text)
    else:
        out["text"] = text
    out["logprobs"] = merge_logprobs(p.get("logprobs"), d.get("logprobs"))
    if "prompt_logprobs" in p:  # P scored the prompt (D was not asked to)
        out["prompt_logprobs"] = p["prompt_logprobs"]
    return out


def merge_logprobs(first: Any, rest: Any) -> Any:
    """P's logprobs (token 1) followed by D's (tokens 2..n); None unless both exist."""
    if first is None or rest is None:
        return None
    if "content" in first:  # chat
        return {"content": list(first["content"] or []) + list(rest["content"] or [])}
    offsets = first["text_offset"]
    shift = offsets[-1] + len(first["tokens"][-1]) if offsets else 0
    return {
        "tokens": first["tokens"] + rest["tokens"],
        "token_logprobs": first["token_logprobs"] + rest["token_logprobs"],
        "top_logprobs": first["top_logprobs"] + rest["top_logprobs"],
        "text_offset": offsets + [o + shift for o in rest["text_offset"]],
    }


def full_body(frame: Frame, legs: list[Leg], choices: list[dict[str, Any]]) -> dict[str, Any]:
    body = frame.envelope(frame.object_full, sorted(choices, key=lambda c: c["index"]))
    body["usage"] = total_usage(legs)
    if frame.chat and legs and legs[0].prompt_logprobs is not None:
        body["prompt_logprobs"] = legs[0].prompt_logprobs  # one prompt: choice 0's
    return body


# -- streams -----------------------------------------------------------------------------
def seed_chunk(leg: Leg) -> dict[str, Any]:
    """P's first token as a chunk choice (already holding the finish when it ended the
    choice). Its logprobs are P's: they cover the first token."""
    assert leg.first is not None
    p = leg.first["choices"][0]
    text = text_of(p)
    leg.shift = len(text)
    lp = p.get("logprobs")
    if lp and lp.get("tokens"):
        # D's offsets go on from the end of P's token texts, as an engine counts them
        # (a token ending inside a character has a text before the stream does; an
        # echoed BOS has a token text and no prompt text).
        leg.shift = lp["text_offset"][-1] + len(lp["tokens"][-1])
    # What D must send again first (a D that resends, when D is asked at all).
    leg.resent = text if leg.resends and not leg.ended_at_prefill else ""
    leg.resent_left = len(leg.resent)
    finish = _finish_of(p) if leg.ended_at_prefill else None
    if "message" in p:
        return {"index": 0, "delta": {"content": text}, "logprobs": p.get("logprobs"),
                "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": p.get("logprobs"), "finish_reason": finish}


class Spliced(Exception):
    """D's first token is not the one the client already got from P."""


def cut_resent(leg: Leg, choice: dict[str, Any]) -> dict[str, Any] | None:
    """D's chunk choice less the text the client already got from P (a decode engine
    that samples the first token again); None when nothing of it is left to send.
    Raises ``Spliced`` where D's text does not begin with P's: the client must not get
    P's token followed by another sequence's rest."""
    if leg.resent_left <= 0:
        return choice
    text = text_of(choice)
    n = min(len(text), leg.resent_left)
    at = len(leg.resent) - leg.resent_left
    if text[:n] != leg.resent[at:at + n]:
        raise Spliced(f"the decode engine sampled another first token ({text[:n]!r}) than "
                      f"the prefill engine's ({leg.resent!r}) already streamed: the stream "
                      "stops here rather than join two sequences")
    leg.resent_left -= n
    if choice.get("finish_reason") is not None:
        check_resent(leg)
    rest = text[n:]
    if not rest and choice.get("finish_reason") is None:
        return None  # the first token again (its logprobs went out with P's chunk)
    if "delta" in choice:
        return dict(choice, delta=dict(choice["delta"], content=rest))
    return dict(choice, text=rest)


def check_resent(leg: Leg) -> None:
    """At the end of D's answer: ``Spliced`` if it ended inside the first token the
    client already got from P (D's sequence is shorter than what was streamed)."""
    if leg.resent_left:
        raise Spliced(f"the decode engine's answer ended inside the first token the "
                      f"prefill engine's stream already sent ({leg.resent!r}): the stream "
                      "stops here rather than join two sequences")


def reframe(
    frame: Frame, leg: Leg, choice: dict[str, Any], shift: int = 0
) -> list[dict[str, Any]]:
    """One upstream chunk choice as the client's chunk(s): its index, the request's id,
    for chat one role chunk per choice (D's own role chunk is dropped), completion text
    offsets counted from the start of the choice's text (``shift``: the text before)."""
    choice = dict(choice, index=leg.index)
    out: list[dict[str, Any]] = []
    if frame.chat:
        delta = {k: v for k, v in (choice.get("delta") or {}).items() if k != "role"}
        choice["delta"] = delta
        if (not delta.get("content") and choice.get("logprobs") is None
                and choice.get("finish_reason") is None and not delta.get("tool_calls")):
            return []  # D's role chunk, or nothing at all
        if not leg.roled:
            leg.roled = True
            out.append(_chunk(frame, {"index": leg.index,
                                      "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}))
    else:
        lp = choice.get("logprobs")
        if lp and shift:
            choice["logprobs"] = dict(lp, text_offset=[o + shift for o in lp["text_offset"]])
    out.append(_chunk(frame, choice))
    return out


def _chunk(frame: Frame, choice: dict[str, Any]) -> dict[str, Any]:
    chunk = frame.envelope(frame.object_chunk, [choice])
    if frame.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(frame: Frame, legs: list[Leg]) -> dict[str, Any]:
    chunk = frame.envelope(frame.object_chunk, [])
    chunk["usage"] = total_usage(legs)
    return chunk
