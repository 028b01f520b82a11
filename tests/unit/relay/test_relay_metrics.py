"""The metric samples the server exports come from the relay objects' counters."""

from __future__ import annotations

from kvrelay.relay import protocol as P
from kvrelay.relay.metrics import as_dict, decode_metrics, prefill_metrics
from tests.sim.race_harness import Pair


def test_metrics_after_a_handover_and_an_expiry() -> None:
    pair = Pair(acquire=1.0)
    kv = pair.prefill("r")
    pair.prefill("s", seed=2)
    mid = as_dict(prefill_metrics(pair.table))
    assert mid["kvrelay_leases_created_total"] == {(): 2.0}
    assert mid["kvrelay_leases"] == {("held",): 2.0, ("pulling",): 0.0}
    pair.submit("r", kv)
    pair.converse()
    pair.now = 5.0
    pair.table.expire(pair.now)
    pair.relay.handle(P.Abort(1, "p1", kv.lease_id, "d1", "a1"), pair.now)  # late: stale
    p = as_dict(prefill_metrics(pair.table))
    assert p["kvrelay_leases"] == {("held",): 0.0, ("pulling",): 0.0}
    assert p["kvrelay_leases_released_total"][("done",)] == 1.0
    assert p["kvrelay_leases_released_total"][("expired",)] == 1.0
    # Every lease created ended once: created == released (none live), from one scrape.
    assert p["kvrelay_leases_created_total"] == {(): 2.0}
    assert sum(p["kvrelay_leases_released_total"].values()) == 2.0
    assert p["kvrelay_relay_stale_messages_total"][()] == 1.0
    d = as_dict(decode_metrics(pair.rx))
    name = pair.rx.transport.name  # issue 21: transfers are labelled by their transport
    assert set(d["kvrelay_kv_transfer_bytes_total"]) == {(name,)}
    assert d["kvrelay_kv_transfer_bytes_total"][(name,)] == pair.rx.stats.transfer_bytes > 0
    assert d["kvrelay_kv_transfers_total"] == {(name,): 1.0}
    assert d["kvrelay_kv_transfer_seconds_count"][()] == 1.0
    assert d["kvrelay_kv_load_fallbacks_total"] == {}


def test_transfers_are_labelled_by_the_transport_auto_chose() -> None:
    """Issue 21: an operator sees which transport carried the bytes. With auto, a
    prefill engine on this host is pulled over shm (tcp for one elsewhere)."""
    import time

    from kvrelay.relay.transports.auto import AutoLink, AutoTransport
    from kvrelay.relay.transports.shm import ShmTransport
    from kvrelay.relay.transports.tcp import TcpTransport
    from kvrelay.sampling_params import SamplingParams
    from tests.unit.relay.test_relay_roundtrip import Decode, Prefill

    p, d = Prefill(), Decode("shm")
    try:
        tcp_client = type(d.client)(compat=d.client.compat, transport="tcp", client_id="d-1")
        d.receiver.link = AutoLink(d.client, tcp_client)
        d.receiver.transport = AutoTransport(ShmTransport(d.kv),
                                             TcpTransport(d.kv, connect=tcp_client.open_data))
        for i in range(2):
            prompt, params = list(range(1, 9 + i)), SamplingParams(max_tokens=3, seed=i)
            d.receiver.submit(f"r{i}", prompt, params, p.prefill(f"r{i}", prompt, params),
                              time.monotonic())
        d.run()
        m = as_dict(decode_metrics(d.receiver))
        assert m["kvrelay_kv_transfers_total"] == {("shm",): 2.0}
        assert m["kvrelay_kv_transfer_bytes_total"] == {
            ("shm",): float(d.receiver.stats.transfer_bytes)}
        tcp_client.close()
    finally:
        d.close()
        p.close()
