"""Fault hooks of the vLLM connector, for tests (knobs in kvrelay/env.py):

- ``KVRELAY_FAULT_VLLM_RAISE=POINT[:N],...``: the N-th unit of work (counted from the
  process's start) that reaches POINT raises ``FaultInjected``; without N, every one.
  Points: ``hold`` (P's worker makes a lease), ``submit`` (D's worker starts a load),
  ``reply`` (D's receiver thread applies a relay reply).
- ``KVRELAY_FAULT_VLLM_HOLD_DELAY_S``: P's worker waits this long before it makes the
  leases of a step (a busy worker: D's ACQUIRE meets NOT_YET meanwhile).
"""

from __future__ import annotations

import threading
import time

from kvrelay import env

POINTS = ("hold", "submit", "reply")
_counts: dict[str, int] = {}
_lock = threading.Lock()


class FaultInjected(RuntimeError):
    pass


def _which(point: str) -> int | None:
    """The unit that fails at ``point``: its number, 0 for every one, None for none."""
    spec = env.get("KVRELAY_FAULT_VLLM_RAISE")
    for item in (spec or "").split(","):
        name, _, n = item.strip().partition(":")
        if name == point:
            return int(n) if n.isdigit() else 0
    return None


def hit(point: str, unit: str) -> None:
    """Raise here if the knob says this unit of work at ``point`` fails."""
    which = _which(point)
    if which is None:
        return
    with _lock:
        _counts[point] = n = _counts.get(point, 0) + 1
    if which in (0, n):
        raise FaultInjected(f"injected fault at {point} ({unit})")


def hold_delay() -> None:
    delay = env.get("KVRELAY_FAULT_VLLM_HOLD_DELAY_S")
    if delay:
        time.sleep(delay)
