"""Conditional disaggregation: the rule (kvrelay.proxy.placement) and how the
proxy feeds it (its prompt-length estimate, the decode engine's expected match before
the prompt enters that engine's record, the prefill engines' in-flight counts)."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.cli import main
from kvrelay.errors import EXIT_USAGE
from kvrelay.proxy.affinity import RoutingConfig
from kvrelay.proxy.legs import Leg
from kvrelay.proxy.placement import Local, PlacementConfig, Work, local_reason
from kvrelay.proxy.routing import Proxy, _landed, _Prefilling
from kvrelay.wire.http import validate
from kvrelay.wire.openai import CompletionRequest

COND = PlacementConfig("conditional", max_tokens=100, queue_tokens=50)


@pytest.mark.parametrize(("prompt", "local", "local_queue", "remote", "want"), [
    (1, 1, 0, 1, Local.SHORT),
    (100, 100, 0, 100, Local.SHORT),  # the threshold is inclusive
    (101, 101, 0, 101, None),  # long, nothing cached, both idle: disaggregated
    (1000, 100, 0, 1000, Local.CACHED),  # 100 tokens left to compute on D
    (1000, 110, 0, 110, None),  # P holds as much of it
    (1000, 110, 0, 1000, Local.BUSY),  # P does not: D computes far less
    (1000, 1000, 0, 1049, None),  # P's backlog 49 tokens longer: not worth moving
    (1000, 1000, 0, 1050, Local.BUSY),  # 50 longer: D finishes it sooner
    (1000, 1000, 500, 1549, None),  # D's own prefills in flight count
    (1000, 1000, 500, 1550, Local.BUSY),
    (1000, 1000, 0, None, None),  # no healthy P: the usual retries, then D
    (50, 50, 10_000, 50, Local.SHORT),  # the first reason that holds is the one counted
])
def test_conditional_rule(prompt: float, local: float, local_queue: float,
                          remote: float | None, want: Local | None) -> None:
    assert local_reason(COND, Work(prompt, local, local_queue, remote)) == want


def test_always_and_never_ignore_the_prompt() -> None:
    for work in (Work(1, 0, 0, 99), Work(10_000, 10_000, 0, 0), Work(10_000, 0, 0, None)):
        assert local_reason(PlacementConfig("always"), work) is None
        assert local_reason(PlacementConfig("never"), work) is Local.ALWAYS


def test_queue_zero_turns_the_busy_rule_off() -> None:
    off = PlacementConfig("conditional", max_tokens=10, queue_tokens=0)
    assert local_reason(off, Work(1000, 1000, 0, 100_000)) is None


@pytest.mark.parametrize(("kw", "flag"), [
    ({"mode": "sometimes"}, "--disaggregation"),
    ({"max_tokens": -1}, "--local-prefill-max-tokens"),
    ({"queue_tokens": -1}, "--local-prefill-queue-tokens"),
])
def test_bad_settings_name_the_flag(kw: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        PlacementConfig(**kw)


def test_proxy_with_a_bad_placement_flag_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["proxy", "--prefill", "http://p", "--decode", "http://d",
                 "--disaggregation", "conditional", "--local-prefill-queue-tokens", "-2"])
    assert code == EXIT_USAGE
    assert "--local-prefill-queue-tokens must be >= 0" in capsys.readouterr().err


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
    first = legs(px, doc + "tail one")
    assert px._to_prefill(first)  # first sight: cold everywhere
    # Routed to D, but D has not answered it yet: the document is still on its way
    # (prefilling on P, then pulled), so a second question on it is not cached there.
    assert px._to_prefill(legs(px, doc + "tail two"))
    assert count(px, "local_cached") == 0
    _landed(first.decoder, first)  # D's first token of it: D holds the document now
    assert not px._to_prefill(legs(px, doc + "tail three"))
    assert count(px, "local_cached") == 1
    # The match is what D held before this leg, not the leg's own prompt just recorded.
    assert px._to_prefill(legs(px, doc[::-1] + "tail four"))


def test_prefill_work_in_flight_moves_a_long_prefill() -> None:
    px = proxy(max_tokens=0, queue_tokens=5)
    p1, p2 = px.prefill.all
    p1.prefilling, p2.prefilling = 20.0, 4.0  # tokens, not yet answered
    leg = legs(px, "x" * 40)  # 10 tokens
    assert px._to_prefill(leg)  # on p2: 14 tokens against 10 on D
    assert leg.remote_tokens == 10
    p2.prefilling = 5.0
    assert not px._to_prefill(legs(px, "y" * 40))
    assert count(px, "local_prefill_busy") == 1
    p2.healthy = False  # an unhealthy engine's backlog does not hold the rule back
    p2.prefilling = 0.0
    assert not px._to_prefill(legs(px, "z" * 40))
    d = px.decode.all[0]
    d.prefilling = 20.0  # D's own prefills in flight: now P is the sooner
    assert px._to_prefill(legs(px, "w" * 40))


def test_an_engines_prefill_work_counts_until_its_first_token() -> None:
    up = Proxy(["http://p"], ["http://d"]).prefill.all[0]
    with _Prefilling(up, 30.0) as work:
        assert up.prefilling == 30.0
        work.done()  # the first token
        assert up.prefilling == 0.0
    assert up.prefilling == 0.0  # and once only
    with pytest.raises(RuntimeError), _Prefilling(up, 7.0):
        raise RuntimeError("the engine failed")
    assert up.prefilling == 0.0


def test_always_routes_decode_after_the_prefill_as_before() -> None:
    px = proxy("always", max_tokens=10_000)
    leg = legs(px, "short")
    assert px._to_prefill(leg) and leg.decoder is None
    assert px.metrics.registry.get_sample_value(
        "kvrelay_proxy_route_total", {"role": "decode", "reason": "least_outstanding"}) is None
