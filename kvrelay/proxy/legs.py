"""A leg: one choice of a client's request, as the one-prompt request its P/D pair
serves, with what the proxy knows of it on the way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvrelay.proxy.upstreams import Upstream

# vLLM's _SAMPLING_EPS: a temperature below it samples greedily.
GREEDY_BELOW = 1e-5


@dataclass(eq=False)
class Leg:
    """One choice of the client's request, as the request its P/D pair serves."""

    index: int  # the choice's index in the client's answer
    counts_prompt: bool  # the first choice of its prompt: its prompt tokens count in usage
    body: dict[str, Any]  # the one-prompt, n=1 request
    # P's answer (first token, maybe the lease) and where it came from; both None when no
    # prefill engine answered and the leg is served colocated by a decode engine.
    first: dict[str, Any] | None = None
    prefill_url: str | None = None
    # The lease while the proxy owns it: None once D has it or it was given back.
    params: dict[str, Any] | None = None
    ended_at_prefill: bool = False  # P's first token ended the choice: no D
    usage: dict[str, int] | None = None
    roled: bool = False  # chat stream: the role chunk of this choice went out
    shift: int = 0  # completion stream: the text offset of D's first token (after P's)
    # The prompt for KV-aware routing (kvrelay.proxy.affinity): its chunks' hash
    # chain and its length in characters.
    chain: list[int] = field(default_factory=list)
    text_len: int = 0
    # Conditional disaggregation (kvrelay.proxy.placement): the prompt's estimated
    # tokens, and the decode engine routed before the prefill was placed.
    tokens: float = 0.0
    decoder: Upstream | None = None
    # The prompt tokens each side would compute (the prompt less the prefix it holds),
    # counted as the engine's prefill work in flight until its first token; None: all.
    local_tokens: float | None = None
    remote_tokens: float | None = None
    # P's params say its decode engine samples the first token again (vLLM's decode
    # engine behind kvrelay.vllm): D's answer is the whole choice. A stream sends P's
    # token early only where D must sample the same one (``streams_first_token``); the
    # text the client already got from P (``resent``, the ``resent_left`` characters
    # still to come from D) is then checked against D's and cut from it.
    resends: bool = False
    resent: str = ""
    resent_left: int = 0
    # Chat: vLLM's top-level prompt_logprobs of the engine that scored the prompt.
    prompt_logprobs: Any = None
    # The answer is read for tool calls (the tool_choice mode: auto, required, named).
    # P samples token 1 under the same grammar (for auto: unconstrained, tool_choice
    # "none" there: the same prompt, no parser needed); D, fed token 1 into its grammar,
    # decodes the rest and answers the whole choice, token 1 included, parsed as a
    # colocated engine parses it. P's answer (its text) is not used.
    tools: str | None = None

    def served_whole(self) -> None:
        """P's answer set aside (its lease already given back): D serves the leg whole."""
        self.first = self.prefill_url = self.params = None
        self.ended_at_prefill = self.resends = False

    def streams_first_token(self) -> bool:
        """May P's first token reach the client before D answers? Yes where D goes on
        after it; where D samples it again, only for a greedy request (D's token is
        checked: a near-tie broken the other way ends the stream, see merge.cut_resent).
        A sampled request streams D's whole sequence: a token sampled twice is two
        draws, and one draw's head on the other's tail is text no engine produced."""
        if self.tools is not None:
            return False  # a tool leg's chunks are all D's
        temperature = self.body.get("temperature")
        greedy = isinstance(temperature, int | float) and temperature < GREEDY_BELOW
        return not self.resends or greedy

    def p_body(self) -> dict[str, Any]:
        """The leg's request as P is asked it (before the prefill-only fields)."""
        if self.tools == "auto":  # P's engine needs no parser (nor its flag) for token 1
            return dict(self.body, tool_choice="none")
        return self.body

    def prefilled(self, first: dict[str, Any], prefill_url: str) -> None:
        """P's answer: the first token, and the lease unless that token ended it."""
        self.first, self.prefill_url = first, prefill_url
        self.params = first.pop("kv_transfer_params", None)
        self.resends = bool(self.params and self.params.get("resends_first_token") is True)
        finish = first["choices"][0].get("finish_reason")
        wanted = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
        self.ended_at_prefill = self.params is None or finish == "stop" or wanted == 1
