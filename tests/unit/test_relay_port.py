"""The relay reaches an engine only through its port (relay/port.py), and a transfer
that does not stop when cancelled is bounded: its blocks are quarantined."""

from __future__ import annotations

import ast
from pathlib import Path

import kvrelay.relay
from kvrelay.core.lifecycle import RequestState
from kvrelay.relay.receiver import Phase
from kvrelay.relay.transports.base import TransferState
from tests.sim.race_harness import NBLOCKS, Pair

FORBIDDEN = {"kvrelay.core.engine", "kvrelay.core.block_pool"}


def test_nothing_in_the_relay_imports_the_engine_or_the_pool() -> None:
    root = Path(kvrelay.relay.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n in FORBIDDEN]
    assert not offenders


def test_a_transfer_deaf_to_cancel_is_quarantined_then_returned() -> None:
    """An abort while copying drains; the transport never stops. After drain_timeout
    the blocks go to a quarantine owner (nothing reuses them), the request ends and P
    is told once; when the transport finally reports, the blocks return."""
    pair = Pair()
    kv = pair.prefill("r")
    pair.submit("r", kv)
    pair.step_d()
    pair.deliver_to_p()
    pair.deliver_to_d()
    (h,) = pair.transport.handles
    pair.transport.land(h, 1)
    pair.rx.abort("r", pair.now)
    assert pair.rx.loads["r"].phase is Phase.DRAINING
    assert pair.d.requests["r"].state is RequestState.DRAINING
    pair.now += pair.rx.config.drain_timeout
    pair.tick()
    owners = pair.d_pool.owners()
    assert owners == {"quarantine:r": len(h.local)}, owners
    assert pair.rx.stats.quarantined_blocks == len(h.local)
    assert "r" not in pair.d.requests and pair.rx.has_work()
    pair.deliver_to_p()  # the ABORT, once
    assert pair.table.stats.released == {"aborted": 1}
    pair.transport.land(h)  # the late transfer writes into quarantined blocks only
    h.status = h.status.__class__(TransferState.FAILED, "cancelled at last")
    pair.deliver_to_d()
    pair.tick()
    assert pair.rx.stats.quarantined_blocks == 0 and not pair.rx.has_work()
    pair.d_pool.check_integrity()
    assert pair.d_pool.num_free == NBLOCKS
    pair.assert_all_free()
