import pytest

from kvrelay.core.lifecycle import (
    HOLDS_BLOCKS,
    TRANSITIONS,
    Event,
    IllegalTransition,
    RequestState,
    next_state,
)

S, E = RequestState, Event

# The expected table, written out independently of TRANSITIONS (DESIGN section 3):
# a change to the code's table that is not also made here fails.
EXPECTED: dict[tuple[RequestState, Event], RequestState] = {
    (S.WAITING, E.SCHEDULE): S.RUNNING,
    (S.WAITING, E.AWAIT_KV): S.WAITING_FOR_KV,
    (S.WAITING, E.FINISH): S.FINISHING,
    (S.PREEMPTED, E.SCHEDULE): S.RUNNING,
    (S.PREEMPTED, E.FINISH): S.FINISHING,
    (S.RUNNING, E.PREEMPT): S.PREEMPTED,
    (S.RUNNING, E.FINISH): S.FINISHING,
    (S.WAITING_FOR_KV, E.LOAD_START): S.LOADING,
    (S.WAITING_FOR_KV, E.LOAD_FAILED): S.WAITING,
    (S.WAITING_FOR_KV, E.FINISH): S.FINISHING,
    (S.LOADING, E.LOAD_DONE): S.RUNNING,
    (S.LOADING, E.LOAD_FAILED): S.WAITING,
    (S.LOADING, E.FINISH): S.DRAINING,
    (S.DRAINING, E.TRANSFER_ENDED): S.FINISHING,
    (S.FINISHING, E.RELEASE): S.FINISHED,
}
LEGAL = sorted(EXPECTED.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))
ILLEGAL = [(s, e) for s in RequestState for e in Event if (s, e) not in EXPECTED]


def test_the_code_has_exactly_the_expected_table() -> None:
    assert TRANSITIONS == EXPECTED


@pytest.mark.parametrize(("key", "target"), LEGAL, ids=lambda x: str(x))
def test_legal_transitions(key: tuple[RequestState, Event], target: RequestState) -> None:
    assert next_state("r", *key) is target


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=lambda x: str(x))
def test_every_illegal_transition_raises_naming_state_and_event(
    state: RequestState, event: Event
) -> None:
    with pytest.raises(IllegalTransition) as err:
        next_state("r7", state, event)
    message = str(err.value)
    assert "r7" in message and state.value in message and event.value in message


def test_finished_is_a_dead_end() -> None:
    assert not [k for k in TRANSITIONS if k[0] is RequestState.FINISHED]


def test_release_only_from_finishing_and_finish_only_once() -> None:
    assert [k for k in TRANSITIONS if k[1] is Event.RELEASE] == [
        (RequestState.FINISHING, Event.RELEASE)
    ]
    for state in (RequestState.FINISHING, RequestState.DRAINING, RequestState.FINISHED):
        assert (state, Event.FINISH) not in TRANSITIONS


def test_states_that_hold_blocks() -> None:
    assert RequestState.WAITING not in HOLDS_BLOCKS
    assert RequestState.PREEMPTED not in HOLDS_BLOCKS
    assert RequestState.FINISHED not in HOLDS_BLOCKS
    assert RequestState.DRAINING in HOLDS_BLOCKS and RequestState.FINISHING in HOLDS_BLOCKS
