"""The relay reaches an engine only through its port (relay/port.py), and a transfer
that does not stop when cancelled is bounded: its blocks are quarantined."""

from __future__ import annotations

import ast
from pathlib import Path

import kvrelay.relay
import kvrelay.vllm
from kvrelay.core.lifecycle import RequestState
from kvrelay.relay import protocol as P
from kvrelay.relay.receiver import Phase
from kvrelay.relay.transports.base import TransferState
from tests.sim.race_harness import NBLOCKS, Pair


def test_the_relay_reaches_the_engine_only_through_its_port() -> None:
    """No module of kvrelay/relay (nor the vLLM adapter) imports kvrelay.core: the
    engine's names the relay needs come from relay/port.py, which alone imports them."""
    offenders = []
    for pkg in (kvrelay.relay, kvrelay.vllm):
        root = Path(pkg.__file__).parent
        for path in sorted(root.rglob("*.py")):
            if path == root / "port.py" and pkg is kvrelay.relay:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom)
                         else [])
                offenders += [f"{path.name}: {n}" for n in names
                              if n == "kvrelay.core" or n.startswith("kvrelay.core.")]
    assert not offenders, offenders


def test_a_transfer_deaf_to_cancel_is_quarantined_then_returned() -> None:
    """An abort while copying drains; the transport never stops. After drain_timeout
    the blocks go to a quarantine owner (nothing reuses them), the request ends and P
    is told once; when the transport finally reports, the blocks return."""
    pair = Pair()
    _, h = pair.start_copy()
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


def test_a_reply_from_another_relay_never_settles_a_load() -> None:
    """Review finding: replies of every relay share one queue and sequence numbers are
    guessable, so a relay named in forged params could answer another request's
    RELEASE(ok) with "done" and make D decode on an unconfirmed copy. The client stamps
    each reply with the relay it came from; the receiver ignores any other relay's."""
    pair = Pair()
    kv, h = pair.start_copy()
    pair.transport.land(h)
    pair.transport.finish(h)
    pair.tick()  # RELEASE(ok) sent: COMMITTING
    release = pair.outbox[-1]
    assert pair.rx.loads["r"].phase is Phase.COMMITTING
    pair.rx.on_reply(P.Reply(release.seq, "ok", reason="done", relay="evil:1"), pair.now)
    assert pair.rx.loads["r"].phase is Phase.COMMITTING, "a forged verdict settled it"
    assert pair.d.requests["r"].state is RequestState.LOADING
    (genuine,) = pair.deliver_to_p()
    genuine.relay = kv.relay
    pair.rx.on_reply(genuine, pair.now)
    assert "r" not in pair.rx.loads and pair.d.requests["r"].state is RequestState.RUNNING
    pair.converse()
    pair.assert_all_free()
