"""The relay's metrics: typed families the server exports with prometheus-client.

Each function reads the counters the relay objects keep (no locks of their own:
call with the engine lock held on the prefill side) and returns ``Family`` records;
counters are totals since start.

    kvrelay_leases{state}                  gauge: live leases (held, pulling)
    kvrelay_leases_created_total           counter: leases made (P); created == the
                                           released ones + the live ones, from one scrape
    kvrelay_leases_released_total{reason}  counter: done, failed, aborted, expired, split
    kvrelay_relay_stale_messages_total     counter: P: messages about released, unknown
                                           or foreign leases; D: replies to an earlier
                                           phase (answered or dropped, nothing else)
    kvrelay_kv_fence_failures_total        counter: P: commits of the attempt that held
                                           the lease, refused (lease released under the
                                           copy, or a block's generation changed); D:
                                           copies discarded for want of a done verdict
    kvrelay_kv_transfer_bytes_total{transport} counter: KV bytes served (P, tcp) / received (D)
    kvrelay_kv_transfers_total{transport}  counter: completed pulls (D)
    kvrelay_kv_pull_skipped_blocks_total   counter: lease blocks not pulled because the
                                           decode engine had them in its prefix cache
                                           (P: released at ACQUIRE; D: shared locally)
    kvrelay_kv_transfer_seconds            histogram: duration of completed pulls (D)
    kvrelay_kv_load_fallbacks_total{reason} counter: loads that ended without remote KV
    kvrelay_kv_quarantined_blocks          gauge: blocks held for transfers that did not
                                           stop within the drain bound (D)
    kvrelay_relay_protocol_errors_total    counter: malformed or out-of-order frames (P)
    and the relay port's own families (P; RelayServer.samples, SERVER_METRIC_HELP):
    kvrelay_relay_connections (gauge), kvrelay_relay_connections_refused_total{cap},
    kvrelay_relay_hello_failures_total{code}, kvrelay_relay_connections_cut_total{reason},
    kvrelay_relay_requests_refused_total{code}
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.receiver import TRANSFER_SECONDS_BUCKETS, Receiver
from kvrelay.relay.server import SERVER_METRIC_HELP, RelayServer

Samples = dict[tuple[str, ...], float]


@dataclass
class Family:
    name: str  # without _total for counters, as prometheus-client wants it
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    samples: Samples = field(default_factory=dict)
    # histogram only: cumulative counts per upper bound, and the sum
    buckets: list[tuple[float, float]] = field(default_factory=list)
    total: float = 0.0


def _counter(name: str, help: str, value: float) -> Family:
    return Family(name, "counter", help, samples={(): float(value)})


def prefill_metrics(table: LeaseTable, server: RelayServer | None = None) -> list[Family]:
    st = table.stats
    out = [
        Family("kvrelay_leases", "gauge", "Live KV leases on this prefill engine, by state",
               ("state",), {(s,): float(n) for s, n in st.active.items()}),
        _counter("kvrelay_leases_created",
                 "KV leases made on this prefill engine (each ends once: released by one "
                 "reason, or live in kvrelay_leases)", st.created),
        Family("kvrelay_leases_released", "counter",
               "KV leases released, by reason (done, failed, aborted, expired; split: cut "
               "into parts, each a lease of its own)", ("reason",),
               {(r,): float(st.released.get(r, 0))
                for r in ("done", "failed", "aborted", "expired", "split")}),
        _counter("kvrelay_relay_stale_messages",
                 "Relay messages about released, unknown or foreign leases", st.stale_messages),
        _counter("kvrelay_kv_fence_failures",
                 "Commits of the pulling attempt refused: the lease was released under the "
                 "copy or a block changed", st.fence_failures),
        _counter("kvrelay_kv_pull_skipped_blocks",
                 "Leading lease blocks the decode engine had in its prefix cache: released "
                 "at ACQUIRE, never sent", st.skipped_blocks),
        Family("kvrelay_lease_tombstones", "gauge",
               "Released leases remembered to answer late messages (kept --lease-max)",
               samples={(): float(table.num_tombstones)}),
    ]
    if server is not None:
        s = server.stats
        out += [
            Family("kvrelay_kv_transfer_bytes", "counter",
                   "KV bytes served to decode engines, by transport (P serves tcp only: "
                   "shm, cuda_ipc and nixl reads are one-sided)", ("transport",),
                   {("tcp",): float(s.bytes_sent)}),
            _counter("kvrelay_relay_protocol_errors",
                     "Relay frames refused as malformed, oversized or out of order",
                     s.protocol_errors),
        ]
        for name, samples in server.samples().items():
            counter = name.endswith("_total")
            out.append(Family(name.removesuffix("_total"), "counter" if counter else "gauge",
                              SERVER_METRIC_HELP[name], _LABELS.get(name, ()), samples))
    return out


# The label of each relay-port family that has one (see RelayServer.samples).
_LABELS = {
    "kvrelay_relay_connections_refused_total": ("cap",),
    "kvrelay_relay_hello_failures_total": ("code",),
    "kvrelay_relay_connections_cut_total": ("reason",),
    "kvrelay_relay_requests_refused_total": ("code",),
}


def decode_metrics(receiver: Receiver, relay_peers: int | None = None) -> list[Family]:
    """``relay_peers``: the relay clients' connected prefill relays (sender threads)."""
    st = receiver.stats
    cumulative, buckets = 0, []
    for bound, n in zip(TRANSFER_SECONDS_BUCKETS, st.transfer_seconds_buckets, strict=True):
        cumulative += n
        buckets.append((bound, float(cumulative)))
    return [
        Family("kvrelay_kv_transfer_bytes", "counter",
               "KV bytes received from prefill engines, by the transport that carried them",
               ("transport",), {(t,): float(n) for t, n in sorted(st.bytes_by_transport.items())}),
        Family("kvrelay_kv_transfers", "counter",
               "Completed KV pulls, by the transport that carried them", ("transport",),
               {(t,): float(n) for t, n in sorted(st.pulls_by_transport.items())}),
        Family("kvrelay_kv_transfer_seconds", "histogram",
               "Duration of completed KV pulls, from the transfer's start to its last byte",
               buckets=buckets, total=st.transfer_seconds_sum),
        _counter("kvrelay_kv_fence_failures",
                 "KV copies discarded: no done verdict from the prefill engine",
                 st.fence_failures),
        _counter("kvrelay_kv_pull_skipped_blocks",
                 "Prompt blocks of remote requests found in this engine's prefix cache: "
                 "shared, not pulled", st.cached_blocks),
        Family("kvrelay_kv_load_fallbacks", "counter",
               "KV loads that ended without remote KV (recompute or fail per policy), by "
               "reason", ("reason",), {(r,): float(n) for r, n in sorted(st.fallbacks.items())}),
        _counter("kvrelay_relay_stale_messages",
                 "Relay replies to a message of an earlier phase (ignored)", st.stale_replies),
        Family("kvrelay_kv_quarantined_blocks", "gauge",
               "KV blocks held for transfers that did not stop within the drain bound",
               samples={(): float(st.quarantined_blocks)}),
        Family("kvrelay_kv_loads", "gauge",
               "Requests whose remote KV is being acquired, pulled or reported",
               samples={(): float(len(receiver.loads))}),
    ] + ([] if relay_peers is None else [
        Family("kvrelay_relay_peers", "gauge",
               "Prefill relays this decode engine keeps a connection and sender thread for",
               samples={(): float(relay_peers)})])


def as_dict(families: list[Family]) -> dict[str, Samples]:
    """name -> samples (counters named with _total), for tests and the demo."""
    out: dict[str, Samples] = {}
    for f in families:
        name = f"{f.name}_total" if f.kind == "counter" else f.name
        if f.kind == "histogram":
            out[f"{name}_count"] = {(): f.buckets[-1][1] if f.buckets else 0.0}
            out[f"{name}_sum"] = {(): f.total}
        else:
            out[name] = f.samples
    return out
