"""The leg's state table (kvrelay/proxy/legs.py): a lease the proxy holds goes back to P
at most once and never after D has it, an event the table lacks raises naming both,
and a finished leg is DONE whatever happened to it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrelay.proxy.legs import LEG_TRANSITIONS, IllegalLegEvent, Leg, LegEvent, LegState

LEASE = {"lease_id": "L", "engine_id": "P"}


def answer(lease: bool, finish: str = "length") -> dict[str, Any]:
    out: dict[str, Any] = {"choices": [{"text": " a", "finish_reason": finish}]}
    if lease:
        out["kv_transfer_params"] = dict(LEASE)
    return out


def test_an_event_the_table_lacks_raises_naming_the_state_and_the_event() -> None:
    leg = Leg(0, True, {"max_tokens": 4})
    with pytest.raises(IllegalLegEvent, match="HAND in state PLANNED"):
        leg.on(LegEvent.HAND)
    assert leg.state is LegState.PLANNED


def test_done_is_final_and_every_state_but_done_can_end() -> None:
    assert not [k for k in LEG_TRANSITIONS if k[0] is LegState.DONE]
    ends = {s for (s, e), t in LEG_TRANSITIONS.items() if e is LegEvent.FINISH}
    assert ends == set(LegState) - {LegState.DONE, LegState.LEASED}  # LEASED: RELEASE first


def test_a_lease_p_answered_is_the_proxys_until_d_has_it() -> None:
    leg = Leg(0, True, {"max_tokens": 4})
    leg.on(LegEvent.PREFILL)
    leg.prefilled(answer(lease=True), "http://p")
    assert leg.state is LegState.LEASED and leg.owns_lease()
    leg.handed()
    assert leg.state is LegState.HANDED and leg.take_lease() is None  # D's now
    leg.finished()
    assert leg.state is LegState.DONE


def test_a_token_that_ends_the_choice_ends_the_leg_at_p() -> None:
    for body, first in [({"max_tokens": 1}, answer(lease=True)),
                        ({"max_tokens": 9}, answer(lease=True, finish="stop")),
                        ({"max_tokens": 9}, answer(lease=False))]:
        leg = Leg(0, True, body)
        leg.on(LegEvent.PREFILL)
        leg.prefilled(first, "http://p")
        assert leg.ended_at_prefill and not leg.owns_lease(), (body, first)


OPS = ["prefill", "answer_leased", "answer_ended", "no_prefill", "hand", "release",
       "serve_whole", "finish"]


@given(st.lists(st.sampled_from(OPS), max_size=12))
def test_any_order_of_operations_gives_a_lease_back_at_most_once(ops: list[str]) -> None:
    """Whatever the proxy's tasks do in whatever order (an operation the table refuses
    raises and changes nothing), a lease goes back to P at most once (taken back, not
    needed after P's answer, or still held when the leg finished), never once D has it,
    and ``finished`` always leaves the leg DONE."""
    leg = Leg(0, True, {"max_tokens": 4})
    given_back = handed = 0
    for op in ops:
        before = leg.state
        try:
            if op == "prefill":
                leg.on(LegEvent.PREFILL)
            elif op in ("answer_leased", "answer_ended"):
                given_back += leg.prefilled(answer(
                    lease=True, finish="length" if op == "answer_leased" else "stop"),
                    "http://p") is not None
            elif op == "no_prefill":
                leg.on(LegEvent.SERVE_WHOLE)
            elif op == "hand":
                leg.handed()
                handed += leg.state is LegState.HANDED and before is LegState.LEASED
            elif op == "release":
                given_back += leg.take_lease() is not None
            elif op == "serve_whole":
                leg.served_whole()
            else:
                given_back += leg.finished() is not None
        except IllegalLegEvent:
            assert leg.state is before
    given_back += leg.finished() is not None
    assert given_back + handed <= 1
    assert leg.state is LegState.DONE
