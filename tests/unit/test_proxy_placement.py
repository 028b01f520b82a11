"""Conditional disaggregation: the rule (kvrelay.server.proxy_placement) and how the
proxy feeds it (its prompt-length estimate, the decode engine's expected match before
the prompt enters that engine's record, the prefill engines' in-flight counts)."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.cli import EXIT_USAGE, main
from kvrelay.server.protocol import CompletionRequest, validate
from kvrelay.server.proxy_affinity import RoutingConfig
from kvrelay.server.proxy_merge import Leg
from kvrelay.server.proxy_placement import Local, PlacementConfig, local_reason
from kvrelay.server.proxy_routing import Proxy

COND = PlacementConfig("conditional", max_tokens=100, queue=3)


@pytest.mark.parametrize(("tokens", "cached", "load", "want"), [
    (1, 0.0, 0, Local.SHORT),
    (100, 0.0, 0, Local.SHORT),  # the threshold is inclusive
    (101, 0.0, 0, None),  # long, nothing cached, P idle: disaggregated
    (1000, 0.9, 0, Local.CACHED),  # 100 tokens left to compute
    (1000, 0.89, 0, None),  # 110 left
    (1000, 1.5, 0, Local.CACHED),  # an estimate past the prompt counts as all of it
    (1000, -1.0, 2, None),
    (1000, 0.0, 3, Local.BUSY),  # every P has 3 in flight
    (1000, 0.0, 2, None),
    (1000, 0.0, None, None),  # no healthy P: the usual retries, then D
    (50, 0.0, 9, Local.SHORT),  # the first reason that holds is the one counted
])
def test_conditional_rule(tokens: float, cached: float, load: int | None,
                          want: Local | None) -> None:
    assert local_reason(COND, tokens, cached, load) == want


def test_always_and_never_ignore_the_prompt() -> None:
    for tokens, cached, load in ((1, 1.0, 99), (10_000, 0.0, 0), (10_000, 0.0, None)):
        assert local_reason(PlacementConfig("always"), tokens, cached, load) is None
        assert local_reason(PlacementConfig("never"), tokens, cached, load) is Local.ALWAYS


def test_queue_zero_turns_the_busy_rule_off() -> None:
    off = PlacementConfig("conditional", max_tokens=10, queue=0)
    assert local_reason(off, 1000, 0.0, 10_000) is None


@pytest.mark.parametrize(("kw", "flag"), [
    ({"mode": "sometimes"}, "--disaggregation"),
    ({"max_tokens": -1}, "--local-prefill-max-tokens"),
    ({"queue": -1}, "--local-prefill-queue"),
])
def test_bad_settings_name_the_flag(kw: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        PlacementConfig(**kw)


def test_proxy_with_a_bad_placement_flag_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["proxy", "--prefill", "http://p", "--decode", "http://d",
                 "--disaggregation", "conditional", "--local-prefill-queue", "-2"])
    assert code == EXIT_USAGE
    assert "--local-prefill-queue must be >= 0" in capsys.readouterr().err


# -- the proxy's inputs to the rule ---------------------------------------------------
def proxy(mode: str = "conditional", **kw: Any) -> Proxy:
    return Proxy(["http://p1", "http://p2"], ["http://d1"], routing=RoutingConfig(
        chunk_chars=16), placement=PlacementConfig(mode, **kw))


def legs(px: Proxy, prompt: str | list[int]) -> Leg:
    data = {"model": "m", "prompt": prompt, "max_tokens": 4}
    (leg,) = [Leg(0, True, dict(data, n=1))]
    px._route_keys([leg], validate(data, CompletionRequest), chat=False)
    return leg


def count(px: Proxy, reason: str) -> float:
    v = px.metrics.registry.get_sample_value(
        "kvrelay_proxy_route_total", {"role": "prefill", "reason": reason})
    return v or 0.0


def test_a_short_prompt_is_placed_on_the_decode_engine_routed_for_it() -> None:
    px = proxy(max_tokens=8)
    leg = legs(px, "x" * 32)  # 8 tokens at 4 characters each
    assert not px._to_prefill(leg)
    assert leg.decoder is px.decode.all[0]
    assert px._decode_order(leg)[0] is leg.decoder
    assert count(px, "local_short_prompt") == 1
    # The decode engine was routed once (at placement), not again for the decode.
    assert px.metrics.registry.get_sample_value(
        "kvrelay_proxy_route_total", {"role": "decode", "reason": "least_outstanding"}) == 1
    assert px._to_prefill(legs(px, "y" * 36))  # 9 tokens


def test_token_id_prompts_count_their_ids() -> None:
    px = proxy(max_tokens=8)
    assert not px._to_prefill(legs(px, list(range(8))))
    assert px._to_prefill(legs(px, list(range(100, 109))))  # (no prefix of the first)


def test_a_prefix_the_decode_engine_holds_is_computed_there() -> None:
    px = proxy(max_tokens=8)
    doc = "".join(chr(65 + i % 26) for i in range(160))  # 10 chunks, 40 tokens
    assert px._to_prefill(legs(px, doc + "tail one"))  # first sight: cold everywhere
    # Its chain is in D's record now: the same document with a new tail is cached.
    assert not px._to_prefill(legs(px, doc + "tail two"))
    assert count(px, "local_cached") == 1
    # The match is what D held before this leg, not the leg's own prompt just recorded.
    assert px._to_prefill(legs(px, doc[::-1] + "tail three"))


def test_every_prefill_engine_busy_moves_the_prefill() -> None:
    px = proxy(max_tokens=0, queue=2)
    p1, p2 = px.prefill.all
    p1.outstanding, p2.outstanding = 2, 1
    assert px._to_prefill(legs(px, "long enough"))
    p2.outstanding = 2
    assert not px._to_prefill(legs(px, "long enough"))
    assert count(px, "local_prefill_busy") == 1
    p2.healthy = False  # an unhealthy engine's count does not hold the rule back
    p1.outstanding = 5
    p2.outstanding = 0
    assert not px._to_prefill(legs(px, "long enough"))


def test_always_routes_decode_after_the_prefill_as_before() -> None:
    px = proxy("always", max_tokens=10_000)
    leg = legs(px, "short")
    assert px._to_prefill(leg) and leg.decoder is None
    assert px.metrics.registry.get_sample_value(
        "kvrelay_proxy_route_total", {"role": "decode", "reason": "least_outstanding"}) is None
