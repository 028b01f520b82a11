"""KV-aware routing's pure parts: the hash chain over prompt text, the per-engine
prefix record (bounded LRU, longest match, prefix-closed eviction) and the choice of
an engine by match and load (kvrelay.proxy.affinity)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.cli import main
from kvrelay.errors import EXIT_USAGE
from kvrelay.proxy.affinity import (
    PrefixRecord,
    Reason,
    RoutingConfig,
    chain_hashes,
    chat_text,
    choose,
    completion_text,
)

texts = st.text(alphabet="ab", max_size=40)
chunks = st.integers(min_value=1, max_value=6)


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """Length of the common prefix of two strings or two hash chains."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- the hash chain --------------------------------------------------------------------
@given(texts, texts, chunks)
def test_chains_agree_exactly_as_far_as_whole_chunks_of_text_agree(a: str, b: str,
                                                                   k: int) -> None:
    ca, cb = chain_hashes(a, k), chain_hashes(b, k)
    assert len(ca) == len(a) // k and len(cb) == len(b) // k
    assert common_prefix(ca, cb) == min(common_prefix(a, b) // k, len(ca), len(cb))


def test_a_chunk_is_named_with_everything_before_it() -> None:
    # The same second chunk after a different first one is a different hash.
    assert chain_hashes("xxyy", 2)[1] != chain_hashes("zzyy", 2)[1]
    assert chain_hashes("x", 2) == []


def test_chat_text_keeps_roles_and_order() -> None:
    sys_ = {"role": "system", "content": "be brief"}
    user = {"role": "user", "content": "be brief"}
    assert chat_text([sys_, user]) != chat_text([user, sys_])
    assert chat_text([sys_]) != chat_text([user])
    # A longer conversation extends the shorter one's text: the same prefix.
    assert chat_text([sys_, user]).startswith(chat_text([sys_]))
    assert chat_text([{"role": "assistant", "content": None}]) == "\x1eassistant\x1f"


def test_token_prompts_and_text_prompts_never_share_a_prefix() -> None:
    assert completion_text("hello") == "hello"
    assert completion_text([1, 22, 3]).endswith("1,22,3")
    assert not completion_text([1, 2]).startswith(completion_text("1,2"))


# -- the record ------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(texts, min_size=1, max_size=15), st.integers(1, 4), st.integers(1, 30),
       texts)
def test_record_is_bounded_prefix_closed_and_matches_the_longest_prefix(
    prompts: list[str], k: int, capacity: int, query: str
) -> None:
    record, unbounded = PrefixRecord(capacity), PrefixRecord(10_000)
    parent: dict[int, int | None] = {}
    for p in prompts:
        chain = chain_hashes(p, k)
        for i, h in enumerate(chain):
            parent[h] = chain[i - 1] if i else None
        record.insert(chain)
        unbounded.insert(chain)
        assert len(record) <= capacity
        # The newest chain is whole when it fits: the LRU evicts older entries first.
        if len(set(chain)) <= capacity:
            assert record.match(chain) == len(chain)
        # Prefix-closed: a recorded chunk's parent is recorded (tails go first).
        for h in parent:
            if h in record and parent[h] is not None:
                assert parent[h] in record
    q = chain_hashes(query, k)
    assert unbounded.match(q) == max(common_prefix(q, chain_hashes(p, k)) for p in prompts)
    assert record.match(q) <= unbounded.match(q)


def test_eviction_takes_the_least_recently_used_tail_first() -> None:
    a, b = chain_hashes("a" * 40, 10), chain_hashes("b" * 40, 10)  # 4 chunks each
    record = PrefixRecord(6)
    record.insert(a)
    record.insert(b)
    assert record.match(b) == 4 and record.match(a) == 2  # a's last two chunks went
    record.insert(a)  # a is the newest now: b loses its tail
    assert record.match(a) == 4 and record.match(b) == 2


# -- the choice ------------------------------------------------------------------------
@dataclass(eq=False)
class Engine:
    name: str
    outstanding: int = 0
    healthy: bool = True
    prefixes: PrefixRecord = field(default_factory=lambda: PrefixRecord(1000))


PROMPT = "shared system prompt " * 20 + "and a short tail"
CFG = RoutingConfig(chunk_chars=16, cache_threshold=0.5, balance_abs_threshold=2)


def engines(n: int = 3) -> list[Engine]:
    return [Engine(f"e{i}") for i in range(n)]


def route(es: list[Engine], text: str = PROMPT, cfg: RoutingConfig = CFG) -> tuple[str, Reason]:
    chain = chain_hashes(text, cfg.chunk_chars)
    e, why = choose(es, chain, len(text), cfg)
    e.prefixes.insert(chain)
    return e.name, why


def test_a_prompt_goes_back_to_the_engine_that_has_its_prefix() -> None:
    es = engines()
    es[0].outstanding = 1  # the least loaded (e1) takes a new prefix
    assert route(es) == ("e1", Reason.LEAST_OUTSTANDING)
    es[1].outstanding = 2  # busier than e2 but within the balance threshold
    assert route(es, PROMPT + " that differs") == ("e1", Reason.PREFIX_MATCH)


def test_a_match_below_the_threshold_is_ignored() -> None:
    es = engines(2)
    route(es, "x" * 16 + "y" * 200)  # e0 holds one chunk of x
    es[0].outstanding = 0
    # One chunk of 16 out of ~100 characters: not worth it; the smaller record wins a tie.
    assert route(es, "x" * 16 + "z" * 80) == ("e1", Reason.LEAST_OUTSTANDING)


def test_an_overloaded_match_gives_way_to_the_least_loaded() -> None:
    es = engines(2)
    assert route(es)[0] == "e0"
    es[0].outstanding = 3  # 3 above e1: beyond balance_abs_threshold 2
    assert route(es) == ("e1", Reason.LOAD_BALANCE)
    # Both hold the prefix now: the less loaded one of the two takes it.
    assert route(es) == ("e1", Reason.PREFIX_MATCH)


def test_an_unhealthy_engine_is_never_picked_by_affinity() -> None:
    es = engines(2)
    assert route(es)[0] == "e0"
    es[0].healthy = False
    assert route(es) == ("e1", Reason.LEAST_OUTSTANDING)
    es[1].healthy = False
    es[1].outstanding = 5
    assert route(es) == ("e0", Reason.NO_HEALTHY)


def test_new_prefixes_spread_over_idle_engines_by_record_size() -> None:
    es = engines(2)
    prompts = [c * 300 for c in "abcd"]
    assert [route(es, p)[0] for p in prompts] == ["e0", "e1", "e0", "e1"]
    assert [route(es, p) for p in prompts] == [
        ("e0", Reason.PREFIX_MATCH), ("e1", Reason.PREFIX_MATCH),
        ("e0", Reason.PREFIX_MATCH), ("e1", Reason.PREFIX_MATCH)]


def test_least_outstanding_policy_ignores_prefixes() -> None:
    cfg = RoutingConfig(policy="least-outstanding")
    es = engines(2)
    es[0].prefixes.insert(chain_hashes(PROMPT, cfg.chunk_chars))
    es[0].outstanding = 1
    assert route(es, cfg=cfg) == ("e1", Reason.LEAST_OUTSTANDING)


def test_a_prompt_shorter_than_a_chunk_goes_to_the_least_loaded() -> None:
    es = engines(2)
    es[0].outstanding = 1
    assert route(es, "hi") == ("e1", Reason.LEAST_OUTSTANDING)
    assert route(es, "hi") == ("e1", Reason.LEAST_OUTSTANDING)


@pytest.mark.parametrize(("kw", "flag"), [
    ({"policy": "random"}, "--routing"),
    ({"chunk_chars": 0}, "--routing-chunk-chars"),
    ({"cache_threshold": 1.5}, "--routing-cache-threshold"),
    ({"balance_abs_threshold": -1}, "--routing-balance-abs-threshold"),
    ({"cache_size": 0}, "--routing-cache-size"),
])
def test_bad_settings_name_the_flag(kw: dict[str, object], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        RoutingConfig(**kw)  # type: ignore[arg-type]


def test_proxy_with_a_bad_routing_flag_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
            "--routing-cache-threshold", "2"]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvrelay proxy: --routing-cache-threshold must be between 0 and 1, got 2.0"]


# -- the proxy's legs ----------------------------------------------------------------------
def _legs(proxy: object, data: dict[str, object], chat: bool) -> list[object]:
    from kvrelay.proxy.routing import _split
    from kvrelay.wire.http import validate
    from kvrelay.wire.openai import ChatCompletionRequest, CompletionRequest

    req = validate(data, ChatCompletionRequest if chat else CompletionRequest)
    legs = _split(data, req, chat)
    proxy._route_keys(legs, req, chat)  # type: ignore[attr-defined]
    return legs


def test_the_proxy_routes_each_prompt_of_a_request_by_its_own_prefix() -> None:
    from kvrelay.proxy.routing import Proxy

    proxy = Proxy(["http://p0", "http://p1"], ["http://d0"])
    system = {"role": "system", "content": "You answer questions about rivers. " * 20}

    def chat(question: str, n: int = 1) -> list[str]:
        data = {"model": "m", "n": n, "messages": [system, {"role": "user",
                                                            "content": question}]}
        return [proxy._pick(proxy.prefill, leg).url  # type: ignore[attr-defined]
                for leg in _legs(proxy, data, chat=True)]

    assert chat("Which is the longest?", n=2) == ["http://p0", "http://p0"]
    assert chat("And the widest?") == ["http://p0"]
    # A batch: its first prompt is new, so it goes to the engine with the smaller record;
    # its second shares the first's prefix and follows it. A chat's system prompt sent
    # as a completion prompt is other text (no roles): it matches nothing.
    story = "Tell me a story about a river " * 10
    batch = {"model": "m", "prompt": [story, story + "in spring"]}
    legs = _legs(proxy, batch, chat=False)
    assert [proxy._pick(proxy.prefill, leg).url for leg in legs] == ["http://p1", "http://p1"]
    text = proxy.metrics.registry.get_sample_value
    assert text("kvrelay_proxy_route_total", {"role": "prefill",
                                              "reason": "prefix_match"}) == 3
    assert text("kvrelay_proxy_route_total", {"role": "prefill",
                                              "reason": "least_outstanding"}) == 2
    legs = _legs(proxy, {"model": "m", "prompt": system["content"]}, chat=False)
    assert proxy._pick(proxy.prefill, legs[0]).url == "http://p1"  # the smaller record
