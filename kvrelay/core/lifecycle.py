"""Request states and the one table of legal transitions.

Every change of a request's state goes through ``transition``; an event that the
table does not allow in the current state raises ``IllegalTransition`` naming both.

Who owns the request's KV blocks in each state:

    state           blocks          notes
    WAITING         none            queued for admission (FCFS)
    PREEMPTED       none            freed by recompute preemption; re-admitted first
    RUNNING         the request     prefill chunks and decode steps
    WAITING_FOR_KV  the request     decode side: allocated, remote KV not yet pulled
    LOADING         the request     decode side: a transfer writes into the blocks
    DRAINING        the request     decode side: aborted while loading; the transfer
                                    may still write, so the blocks stay until it ends
    FINISHING       the request     terminal decided, output emitted; a step that
                                    has not landed (output not applied, or its
                                    device work not done) may still read or write
                                    the blocks (the fence)
    FINISHED        none            released exactly once: freed, or handed to a
                                    lease (prefill side, reason REMOTE_DECODE)

FINISHED is entered once; later events for the request are counted no-ops at the
engine, never a second release.
"""

from __future__ import annotations

import enum


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREEMPTED = "preempted"
    RUNNING = "running"
    WAITING_FOR_KV = "waiting_for_kv"
    LOADING = "loading"
    DRAINING = "draining"
    FINISHING = "finishing"
    FINISHED = "finished"


class Event(enum.Enum):
    SCHEDULE = "schedule"  # admitted: blocks allocated for the first chunk
    PREEMPT = "preempt"  # blocks freed; the request recomputes later
    AWAIT_KV = "await_kv"  # decode side: admitted with blocks, remote KV expected
    LOAD_START = "load_start"  # decode side: the transfer begins writing
    LOAD_DONE = "load_done"  # decode side: KV validated, decoding continues
    LOAD_FAILED = "load_failed"  # decode side: transfer ended without valid KV; blocks freed
    FINISH = "finish"  # terminal decided (stop, length, abort, error, remote_decode)
    TRANSFER_ENDED = "transfer_ended"  # decode side: a drained transfer stopped writing
    RELEASE = "release"  # fence clear: blocks freed or handed to a lease


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    REMOTE_DECODE = "remote_decode"


class Failure(enum.Enum):
    """Why a request ended with ERROR, as a code: the server maps it to an HTTP status
    (STYLE habit 15: what crosses components is a code, never a message to match)."""

    STEP = "step"  # the model step raised: the server's fault
    KV_PARAMS = "kv_params"  # the client's kv_transfer_params name no KV it may pull
    KV_LOAD = "kv_load"  # the KV could not be loaded and the policy is to fail
    ENGINE = "engine"  # the engine loop itself failed


S, E = RequestState, Event

TRANSITIONS: dict[tuple[RequestState, Event], RequestState] = {
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
    # An abort while the transfer still writes into our blocks: drain first.
    (S.LOADING, E.FINISH): S.DRAINING,
    (S.DRAINING, E.TRANSFER_ENDED): S.FINISHING,
    (S.FINISHING, E.RELEASE): S.FINISHED,
}

HOLDS_BLOCKS = frozenset(
    {S.RUNNING, S.WAITING_FOR_KV, S.LOADING, S.DRAINING, S.FINISHING}
)
TERMINAL_DECIDED = frozenset({S.DRAINING, S.FINISHING, S.FINISHED})

del S, E


class IllegalTransition(RuntimeError):
    def __init__(self, request_id: str, state: RequestState, event: Event) -> None:
        super().__init__(
            f"request {request_id}: event {event.value!r} is not allowed in state "
            f"{state.value!r}"
        )
        self.state = state
        self.event = event


def next_state(request_id: str, state: RequestState, event: Event) -> RequestState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(request_id, state, event) from None
