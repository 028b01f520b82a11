import pytest

from kvrelay.core.lifecycle import (
    HOLDS_BLOCKS,
    TRANSITIONS,
    Event,
    IllegalTransition,
    RequestState,
    next_state,
)

LEGAL = sorted(TRANSITIONS.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))
ILLEGAL = [
    (s, e) for s in RequestState for e in Event if (s, e) not in TRANSITIONS
]


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
