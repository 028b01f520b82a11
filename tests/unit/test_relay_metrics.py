"""The metric samples the server exports come from the relay objects' counters."""

from __future__ import annotations

from kvrelay.relay import protocol as P
from kvrelay.relay.metrics import as_dict, decode_metrics, prefill_metrics
from tests.sim.race_harness import Pair


def test_metrics_after_a_handover_and_an_expiry() -> None:
    pair = Pair(acquire=1.0)
    kv = pair.prefill("r")
    pair.prefill("s", seed=2)
    pair.submit("r", kv)
    pair.converse()
    pair.now = 5.0
    pair.table.expire(pair.now)
    pair.relay.handle(P.Abort(1, "p1", kv.lease_id, "d1", "a1"), pair.now)  # late: stale
    p = as_dict(prefill_metrics(pair.table))
    assert p["kvrelay_leases"] == {("held",): 0.0, ("pulling",): 0.0}
    assert p["kvrelay_leases_released_total"][("done",)] == 1.0
    assert p["kvrelay_leases_released_total"][("expired",)] == 1.0
    assert p["kvrelay_relay_stale_messages_total"][()] == 1.0
    d = as_dict(decode_metrics(pair.rx))
    assert d["kvrelay_kv_transfer_bytes_total"][()] > 0
    assert d["kvrelay_kv_transfer_seconds_count"][()] == 1.0
    assert d["kvrelay_kv_load_fallbacks_total"] == {}
