"""A leg: one choice of a client's request, as the one-prompt request its P/D pair
serves, with what the proxy knows of it on the way, and its state table.

Who owns the leg's lease, by state: the proxy while LEASED (it gives it back to P if D
never gets it: RELEASE); D once HANDED (D's 200: it pulls the lease or gives it back
itself); nobody in the other states (no lease was made, or it went back to P).

    PLANNED -PREFILL-> PREFILLING -LEASE-> LEASED -HAND-> HANDED -FINISH-> DONE
    PLANNED | PREFILLING -SERVE_WHOLE-> COLOCATED -FINISH-> DONE   (D alone, no P answer)
    PLANNED | PREFILLING -FINISH-> DONE                            (client gone, refused)
    PREFILLING | LEASED -END_AT_P-> ENDED_AT_P -FINISH-> DONE      (P's token ended it)
    ENDED_AT_P -SERVE_WHOLE-> COLOCATED                            (a tool leg: D parses)
    LEASED -RELEASE-> RELEASED -FINISH-> DONE                      (back to P)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvrelay.proxy.upstreams import Upstream

# vLLM's _SAMPLING_EPS: a temperature below it samples greedily.
GREEDY_BELOW = 1e-5


class LegState(enum.Enum):
    PLANNED = "planned"  # split from the client's request, no engine asked yet
    PREFILLING = "prefilling"  # P asked for token 1 and a lease
    LEASED = "leased"  # P answered; the proxy holds the lease until D has it
    ENDED_AT_P = "ended_at_p"  # P's token ended the choice (EOS, max_tokens 1): no D
    COLOCATED = "colocated"  # D serves the whole choice, with no P answer to use
    HANDED = "handed"  # D answered 200: the lease is D's
    RELEASED = "released"  # the proxy gave the lease back to P: D never got it
    DONE = "done"  # the leg's answer is complete (or it failed)


class LegEvent(enum.Enum):
    PREFILL = "prefill"
    LEASE = "lease"
    END_AT_P = "end_at_p"
    SERVE_WHOLE = "serve_whole"
    HAND = "hand"
    RELEASE = "release"
    FINISH = "finish"


_S, _E = LegState, LegEvent
LEG_TRANSITIONS: dict[tuple[LegState, LegEvent], LegState] = {
    (_S.PLANNED, _E.PREFILL): _S.PREFILLING,
    (_S.PLANNED, _E.SERVE_WHOLE): _S.COLOCATED,
    (_S.PLANNED, _E.FINISH): _S.DONE,  # the client left, or the request was refused
    (_S.PREFILLING, _E.LEASE): _S.LEASED,
    (_S.PREFILLING, _E.END_AT_P): _S.ENDED_AT_P,
    (_S.PREFILLING, _E.SERVE_WHOLE): _S.COLOCATED,  # no prefill engine answered
    # The client left, or P refused: a lease P made is given back by its release key.
    (_S.PREFILLING, _E.FINISH): _S.DONE,
    (_S.LEASED, _E.END_AT_P): _S.ENDED_AT_P,  # its lease given back: not needed
    (_S.LEASED, _E.HAND): _S.HANDED,
    (_S.LEASED, _E.RELEASE): _S.RELEASED,
    (_S.ENDED_AT_P, _E.SERVE_WHOLE): _S.COLOCATED,
    (_S.ENDED_AT_P, _E.FINISH): _S.DONE,
    (_S.COLOCATED, _E.FINISH): _S.DONE,
    (_S.HANDED, _E.FINISH): _S.DONE,
    (_S.RELEASED, _E.FINISH): _S.DONE,
}


class IllegalLegEvent(RuntimeError):
    """An event the leg's state table lacks: a bug in the proxy, never the client's."""


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
    state: LegState = LegState.PLANNED
    # P's lease (kv_transfer_params as P answered them); the proxy owns it while LEASED.
    params: dict[str, Any] | None = None
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

    def on(self, event: LegEvent) -> None:
        nxt = LEG_TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise IllegalLegEvent(f"leg {self.index}: {event.name} in state {self.state.name}")
        self.state = nxt

    @property
    def ended_at_prefill(self) -> bool:
        return self.state is LegState.ENDED_AT_P

    def owns_lease(self) -> bool:
        """Does the proxy hold a lease D has not got (and so must give back if D never
        does)?"""
        return self.state is LegState.LEASED

    def served_whole(self) -> None:
        """No P answer to use: D serves the leg whole, as colocated work (a leg placed on
        D, no prefill engine answered, or a tool leg whose token 1 ended it, its lease
        already given back)."""
        self.on(LegEvent.SERVE_WHOLE)
        self.first = self.prefill_url = self.params = None
        self.resends = False

    def handed(self) -> None:
        """D answered 200: a lease the proxy held is D's now."""
        if self.state is LegState.LEASED:
            self.on(LegEvent.HAND)

    def take_lease(self) -> dict[str, Any] | None:
        """The lease to give back to P when D never got it (RELEASE), else None."""
        if self.state is not LegState.LEASED:
            return None
        self.on(LegEvent.RELEASE)
        return self.params

    def finished(self) -> dict[str, Any] | None:
        """The leg's answer is complete, or it failed: nothing of it is the proxy's now.
        Returns the lease it still held (RELEASE), for the caller to give back to P."""
        lease = self.take_lease()
        if self.state is not LegState.DONE:
            self.on(LegEvent.FINISH)
        return lease

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

    def prefilled(self, first: dict[str, Any], prefill_url: str) -> dict[str, Any] | None:
        """P's answer: the first token, and the lease unless that token ended it. Returns
        a lease P made all the same but nobody needs, for the caller to give back: once,
        since P answers a leg once (the state table refuses a second answer)."""
        if self.state is not LegState.PREFILLING:
            raise IllegalLegEvent(f"leg {self.index}: P's answer in state {self.state.name}")
        self.first, self.prefill_url = first, prefill_url
        self.params = first.pop("kv_transfer_params", None)
        self.resends = bool(self.params and self.params.get("resends_first_token") is True)
        finish = first["choices"][0].get("finish_reason")
        wanted = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
        if self.params is not None:
            self.on(LegEvent.LEASE)
        if self.params is None or finish == "stop" or wanted == 1:
            self.on(LegEvent.END_AT_P)
            return self.params
        return None
