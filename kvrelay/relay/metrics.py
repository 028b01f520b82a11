"""The relay's metrics, as plain samples the server exports with prometheus-client.

Each function reads the counters the relay objects keep (no locks of their own:
call with the engine lock held on the prefill side) and returns
``{metric name: {label tuple: value}}``; counters are totals since start.

    kvrelay_leases                          gauge, {state}: live leases (held, pulling)
    kvrelay_leases_released_total           counter, {reason}: done, failed, aborted, expired
    kvrelay_relay_stale_messages_total      counter: messages about released, unknown or
                                            foreign leases (answered, otherwise ignored)
    kvrelay_kv_fence_failures_total         counter: copies refused at commit (P side) /
                                            discarded by the receiver (D side)
    kvrelay_kv_transfer_bytes_total         counter: KV bytes served (P, tcp) or received (D)
    kvrelay_kv_transfer_seconds             summary: sum and count of completed transfers (D)
    kvrelay_kv_load_fallbacks_total         counter, {reason}: loads that ended without
                                            remote KV (recompute or fail per policy)
"""

from __future__ import annotations

from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.receiver import Receiver
from kvrelay.relay.server import RelayServer

Samples = dict[str, dict[tuple[str, ...], float]]


def prefill_metrics(table: LeaseTable, server: RelayServer | None = None) -> Samples:
    st = table.stats
    out: Samples = {
        "kvrelay_leases": {(state,): float(n) for state, n in st.active.items()},
        "kvrelay_leases_released_total": {
            (reason,): float(st.released.get(reason, 0))
            for reason in ("done", "failed", "aborted", "expired")
        },
        "kvrelay_relay_stale_messages_total": {(): float(st.stale_messages)},
        "kvrelay_kv_fence_failures_total": {(): float(st.fence_failures)},
    }
    if server is not None:
        out["kvrelay_kv_transfer_bytes_total"] = {(): float(server.stats.bytes_sent)}
    return out


def decode_metrics(receiver: Receiver) -> Samples:
    st = receiver.stats
    return {
        "kvrelay_kv_transfer_bytes_total": {(): float(st.transfer_bytes)},
        "kvrelay_kv_transfer_seconds_sum": {(): st.transfer_seconds_sum},
        "kvrelay_kv_transfer_seconds_count": {(): float(st.transfer_seconds_count)},
        "kvrelay_kv_fence_failures_total": {(): float(st.fence_failures)},
        "kvrelay_kv_load_fallbacks_total": {
            (reason,): float(n) for reason, n in sorted(st.fallbacks.items())
        },
        "kvrelay_relay_stale_messages_total": {(): float(st.stale_replies)},
    }
