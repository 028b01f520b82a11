"""Completion streams' text offsets advance by the token texts reported (as vLLM's and
as a whole answer's), not by the text sent, and also over a token sent without logprobs
(a decode engine's token 1 when the proxy in front did not send it)."""

from __future__ import annotations

from kvrelay.core.runner import TokenLogprobs
from kvrelay.server.bodies import CompletionShape
from kvrelay.server.generation import Delta
from kvrelay.wire.openai import LogprobFormatter

TEXTS = {1: "a", 2: "\ufffd", 3: "bc"}  # token 2 ends inside a character


def test_offsets_follow_token_texts() -> None:
    shape = CompletionShape("cmpl-x", "m", True, LogprobFormatter(TEXTS.__getitem__))
    lp = [TokenLogprobs(-1.0, [])]
    sent = 0  # the text the stream sent so far (what offsets once counted)
    offsets = []
    for delta in (Delta(0, "a", [1], None), Delta(0, "", [2], lp), Delta(0, "xbc", [3], lp)):
        choice = shape.chunk(delta, sent)["choices"][0]
        sent += len(delta.text)
        if choice["logprobs"] is not None:
            offsets.extend(choice["logprobs"]["text_offset"])
    assert offsets == [1, 2]  # "a", then the replacement character's one
