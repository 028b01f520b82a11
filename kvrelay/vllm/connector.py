"""``KvRelayConnector``: vLLM's KV connector API (0.32) onto kvrelay's relay.

Which process runs what (vLLM's MP executor: the scheduler in EngineCore, the worker
that owns the KV memory in a process of its own; nothing shared but what vLLM pickles
between them):

- scheduler (``KVConnectorRole.SCHEDULER``): decides. Prefill: ``request_finished``
  names a lease (``<worker engine id>.<n>``, from the worker's handshake) for a request
  that asked for remote decode and finished by length, returns ``delay_free=True`` with
  the params, and hands the lease's making to the worker in the next step's metadata
  (no round trip on vLLM's scheduler thread; an ACQUIRE that comes first is answered
  NOT_YET). Decode: ``get_num_new_matched_tokens`` validates the params before vLLM
  allocates anything; ``update_state_after_alloc`` queues the load with its blocks;
  ``build_connector_meta`` hands loads and aborts to the worker.
- worker (``KVConnectorRole.WORKER``): the lease table and relay server (prefill.py),
  the receiver and its transport (decode.py). ``get_transfer_results`` reports each
  lease's one release as ``finished_sending`` and each load's one outcome as
  ``finished_recving`` (plus ``failed_recving`` for a fallback).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvrelay.relay.geometry import KvGeometry
from kvrelay.relay.prefill import KvTransferParams
from kvrelay.relay.remote import RemoteKv
from kvrelay.relay.transports.layout import head_part, named_as, widened
from kvrelay.vllm.api import (
    P2P_SOURCE,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorTransferResults,
)
from kvrelay.vllm.decode import (
    UNTRUSTED,
    DecodeSide,
    LoadSpec,
    MappedDecode,
    mapped_size,
    p_ranks_refused,
    rank_entries,
    trusts,
)
from kvrelay.vllm.devices import buffer_device, kv_cache_dtype, worker_cache
from kvrelay.vllm.drafter import drafter_of, target_layers
from kvrelay.vllm.prefill import HoldSpec, PrefillSide, prompt_digest
from kvrelay.vllm.settings import ConnectorSettings, relay_cpus, run_on_relay_cpus

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _join_vllm_logging() -> None:
    """kvrelay's records go through vLLM's logging configuration: the ``kvrelay``
    logger becomes a child of ``vllm`` (its handlers, format and VLLM_LOGGING_LEVEL),
    unless the operator configured ``kvrelay`` itself (VLLM_LOGGING_CONFIG_PATH). No
    handler is added anywhere. Per-request lines are DEBUG."""
    ours = logging.getLogger("kvrelay")
    if not ours.handlers and ours.level == logging.NOTSET and ours.propagate:
        ours.parent = logging.getLogger("vllm")


_join_vllm_logging()
_LOADED = "_kvrelay_loaded"  # set in a request's params once its load was queued


@dataclass
class KvRelayMetadata(KVConnectorMetadata):
    holds: list[HoldSpec] = field(default_factory=list)  # leases for P's worker to make
    loads: list[LoadSpec] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    give_back: list[dict[str, Any]] = field(default_factory=list)  # leases never loaded
    idle: bool = False  # nothing scheduled: vLLM steps only to collect our reports


@dataclass
class KvRelayStats(KVConnectorStats):
    """What the connector did in the last interval; vLLM's stat logger prints it as
    "KV Transfer metrics: ..." every log interval (--disable-log-stats: never). ``data``
    crosses processes as plain lists and dicts."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        # "quarantined" (a gauge) is present only when its value changed.
        empty: dict[str, Any] = {"load_ms": [], "load_bytes": [], "fallbacks": {},
                                 "fence_refused": 0, "leases_ended": {}, "leases_made": 0}
        self.data = empty

    def aggregate(self, other: KVConnectorStats) -> KvRelayStats:
        if not other.is_empty():
            d: dict[str, Any] = self.data
            o: dict[str, Any] = other.data
            d["load_ms"] = [*d["load_ms"], *o["load_ms"]]
            d["load_bytes"] = [*d.get("load_bytes", ()), *o.get("load_bytes", ())]
            d["fence_refused"] += o["fence_refused"]
            d["leases_made"] = d.get("leases_made", 0) + o.get("leases_made", 0)
            if "quarantined" in o:  # the latest count of each worker, summed
                d["quarantined"] = d.get("quarantined", 0) + o["quarantined"]
            for key in ("fallbacks", "leases_ended"):
                for why, n in o[key].items():
                    d[key][why] = d[key].get(why, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        d: dict[str, Any] = self.data
        ms: list[float] = sorted(d["load_ms"])
        out: dict[str, int | float] = {
            "Num successful pulls": len(ms),
            "Avg load time (ms)": round(sum(ms) / len(ms), 3) if ms else 0,
            "P90 load time (ms)": round(ms[int(0.9 * (len(ms) - 1))], 3) if ms else 0,
            "Num fallbacks": sum(d["fallbacks"].values()),
            "Num fence refusals": d["fence_refused"],
            "Num leases made": d.get("leases_made", 0),
            "Num quarantined": d.get("quarantined", 0),
        }
        out.update({f"Fallbacks {why}": n for why, n in sorted(d["fallbacks"].items())})
        out.update({f"Leases {why}": n for why, n in sorted(d["leases_ended"].items())})
        return out

    def is_empty(self) -> bool:
        d: dict[str, Any] = self.data
        return not (d["load_ms"] or d["fallbacks"] or d["fence_refused"] or d["leases_ended"]
                    or d.get("leases_made") or "quarantined" in d)


@dataclass
class KvRelayHandshake(KVConnectorHandshakeMetadata):
    """What P's scheduler needs of each worker to name leases: the relay's address, the
    engine id (a lease id's prefix; it changes with every worker life) and the compat
    (with tensor parallelism it names the worker's rank: its own heads)."""

    relay: str
    engine_id: str
    compat: str


class KvRelayConnector(KVConnectorBase_V1):
    if P2P_SOURCE is not None:  # vLLM 0.34: prompt tokens from a peer engine's KV
        _cache_hit_source = P2P_SOURCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = self._kv_transfer_config
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise ValueError(
                f"KvRelayConnector does not serve pipeline parallelism yet: this engine "
                f"has pipeline parallel size {pc.pipeline_parallel_size} (allowed: 1; "
                f"tensor parallelism is served)")
        # Each tensor-parallel worker serves (P) and pulls (D) its own heads: a relay
        # and a lease per worker, each reported by its worker once.
        self.tp_size = int(pc.tensor_parallel_size)
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError(_groups_refused(vllm_config, kv_cache_config))
        # Each worker's KV heads (a prefill engine of more workers must split them evenly)
        self._heads = _worker_heads(vllm_config, kv_cache_config)
        self.settings = ConnectorSettings.from_extra(cfg.kv_connector_extra_config)
        self.producer, self.consumer = cfg.is_kv_producer, cfg.is_kv_consumer
        self.block_size = int(vllm_config.cache_config.block_size)
        # dim 0 of a layer's view counts kernel blocks, num_blocks * k of them
        self._num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config else None
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        # scheduler side
        self._handshakes: list[KvRelayHandshake] = []  # one per tensor-parallel rank
        self._lease_seq = itertools.count(1)
        self._meta = KvRelayMetadata()
        self._loading: dict[str, Request] = {}  # loads handed to the worker, unreported
        # worker side
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        # Heterogeneous TP (D): the sides pulling from a P of another size, by its size,
        # built at its first load (``_decode_for``).
        self._mapping: Callable[[int], MappedDecode] | None = None
        self._mapped: dict[int, MappedDecode] = {}
        self._ready = threading.Event()  # a report is queued (either side)
        self._unheld: set[str] = set()  # holds no worker of ours could take
        if role == KVConnectorRole.SCHEDULER:
            self._log_start(cfg)

    def _log_start(self, cfg: Any) -> None:
        s = self.settings
        side = "/".join(n for n, on in (("prefill", self.producer), ("decode", self.consumer))
                        if on)
        trust = ("relay_secret set: every relay must prove it" if s.secret else
                 "no relay_secret: D pulls only from relays on its own host"
                 if not s.trust_unauthenticated_relays else
                 "no relay_secret and trust_unauthenticated_relays: any relay a client "
                 "names may plant KV in D's prefix cache")
        log.info("kvrelay: KvRelayConnector (%s; kv_transport %s, lease_timeout %g s, "
                 "lease_max %g s, idle_step_ms %g; %s)", side, s.kv_transport,
                 s.lease_timeout, s.lease_max, s.idle_step_ms, trust)
        if self.consumer and getattr(cfg, "kv_load_failure_policy", "fail") == "fail":
            log.warning("kvrelay: kv_load_failure_policy is 'fail': every load that does "
                        "not commit (P restarted, lease expired, fence refused) becomes an "
                        "error for its client; set \"kv_load_failure_policy\": \"recompute\"")

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """LBHNC (heads outside tokens: a block of a layer one contiguous page), as
        NixlConnector asks, so that two engines whose backends allow it agree on the
        layout the HELLO checks; vLLM drops it with a warning where a backend cannot
        (FlashInfer on SM100 and CPU take it; FlashAttention declares nothing). MLA:
        none, its single head makes every layout the same bytes."""
        mc = getattr(vllm_config, "model_config", None)
        return None if mc is None or getattr(mc, "use_mla", False) else "LBHNC"

    # ==== vLLM 0.33 / 0.34 hooks ===========================================================
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM 0.33+: no. The relay keeps views of the KV memory and NIXL registrations
        of it, which sleep releases and wake remaps: vLLM refuses --enable-sleep-mode."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any = None) -> Any:
        """vLLM 0.34: how the KV cache may be allocated. tcp: IN_PROCESS (the relay reads
        the blocks in place, or stages them, in this process); nixl: REGISTERS (NIXL
        registers the cache with UCX: each segment must be one physical allocation);
        cuda_ipc: LEGACY_IPC (torch's CUDA IPC handles of the cache's allocations)."""
        from vllm.config.kv_transfer import KVCacheAccess

        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
        if extra.get("kv_transport") == "nixl":
            return KVCacheAccess.REGISTERS
        if extra.get("kv_transport") == "cuda_ipc":
            return KVCacheAccess.LEGACY_IPC
        return KVCacheAccess.IN_PROCESS

    def may_load_async(self, request: Request) -> bool:
        """vLLM 0.34: may this request's load start while the batch is full? Keyed on
        kvrelay's own lease field (a router rewriting ``do_remote_prefill`` changes
        nothing); cheap, as vLLM asks: params are validated later, and refused ones
        (``_LOADED``) answer False from then on."""
        params = request.kv_transfer_params
        return bool(self.consumer and params and isinstance(params.get("lease_id"), str)
                    and not params.get(_LOADED))

    # ==== worker ===========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # A drafter's layers stay local: the lease and compat cover the target's alone.
        drafter = drafter_of(self._vllm_config)
        kv_caches = target_layers(kv_caches, drafter)
        backend = _backend_name(self._vllm_config, None if drafter is None else list(kv_caches))
        cache = worker_cache(kv_caches, self._num_blocks, backend, self.settings,
                             buffer_device(self._vllm_config))
        layout = cache.layout
        first = next(iter(kv_caches.values()))
        mc = self._vllm_config.model_config
        geometry = KvGeometry(
            architecture=",".join(mc.architectures or ()), num_layers=layout.layers,
            num_kv_heads=mc.get_num_kv_heads(self._vllm_config.parallel_config),
            head_dim=mc.get_head_size(), block_size=self.block_size,
            dtype=str(first.dtype).removeprefix("torch."), layout=layout.name)
        rank, worker = _worker_index(self._vllm_config)
        kv_dtype, scales = kv_cache_dtype(self._vllm_config, list(kv_caches),
                                          geometry.dtype)
        model_id = f"vllm:{mc.served_model_name}"
        if scales:  # an 8-bit cache: its format and the scales its bytes are read under
            model_id += f"|kv={kv_dtype}|scales={scales}"
        own_id = model_id
        if self.tp_size > 1:  # each rank holds its own heads: pulled by D's same rank
            own_id += f"|tp{rank}/{self.tp_size}"
        compat = geometry.compat_hash(own_id)
        engine_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        # Built on a thread bound to the relay's CPUs: the threads they start run there,
        # not on the core vLLM bound this thread to.
        if self.producer:
            self.prefill = run_on_relay_cpus(self.settings, lambda: PrefillSide(
                self.settings, cache, compat, engine_id, self._ready, worker=worker,
                kv_dtype=kv_dtype))
            _check_reachable(self.prefill.server.address)
        if self.consumer:
            self.decode = run_on_relay_cpus(self.settings, lambda: DecodeSide(
                self.settings, cache, compat, engine_id, self._ready, rank=rank,
                workers=self.tp_size, kv_dtype=kv_dtype))

            def mapped(p_workers: int) -> MappedDecode:
                p_heads = max(1, mc.get_total_num_kv_heads() // p_workers)

                def p_compat(p_rank: int, p_layout: str) -> str:
                    rank_id = f"|tp{p_rank}/{p_workers}" if p_workers > 1 else ""
                    return dataclasses.replace(
                        geometry, num_kv_heads=p_heads, layout=p_layout,
                    ).compat_hash(model_id + rank_id)

                if p_workers < self.tp_size:
                    # P has 1/k of our workers: our heads are slice rank%k of k of P's
                    # rank rank//k's; we pull that part of its leases (MappedDecode).
                    k = self.tp_size // p_workers
                    wide = widened(cache, k).name
                    log.info("kvrelay: pulling from prefill engines of %d tensor-parallel "
                             "workers: this worker's heads are part %d of %d of their rank "
                             "%d's", p_workers, rank % k, k, rank // k)
                    return MappedDecode([DecodeSide(
                        self.settings, cache, p_compat(rank // k, wide), engine_id,
                        self._ready, rank=rank // k, workers=p_workers, kv_dtype=kv_dtype,
                        part=(rank % k, k), layout=wide)])
                # P has k times our workers: our heads are P's ranks rank*k .. rank*k+k-1
                # (MappedDecode); each side pulls its P rank's lease into its slice.
                k = p_workers // self.tp_size
                sides = []
                for i in range(k):
                    part = named_as(head_part(cache, i, k), cache)
                    p_rank = rank * k + i
                    sides.append(DecodeSide(self.settings, part,
                                            p_compat(p_rank, part.layout.name), engine_id,
                                            self._ready, rank=p_rank, workers=p_workers,
                                            kv_dtype=kv_dtype))
                log.info("kvrelay: pulling from prefill engines of %d tensor-parallel "
                         "workers: this worker's heads are those of their ranks %d-%d",
                         p_workers, rank * k, rank * k + k - 1)
                return MappedDecode(sides)

            self._mapping = mapped
        log.info("kvrelay: worker relay threads on CPUs %s (block layout %s, compat %s)",
                 _ranges(relay_cpus(self.settings)), layout.name, compat)

    def get_handshake_metadata(self) -> KvRelayHandshake | None:
        if self.prefill is None:
            return None
        return KvRelayHandshake(self.prefill.server.address, self.prefill.engine_id,
                                self.prefill.compat)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's metadata, before its forward pass (vLLM 0.32 and 0.34 start loads
        after it): the leases the scheduler named are made here, a forward pass sooner
        than in ``start_load_kv``."""
        super().bind_connector_metadata(connector_metadata)
        holds = getattr(connector_metadata, "holds", None)
        if not holds:
            return
        if self.prefill is not None:
            self.prefill.hold_all(holds)
        else:  # named for a worker that is not a producer: vLLM frees them
            log.error("kvrelay: %d leases named for a worker with no relay: their "
                      "requests are freed", len(holds))
            self._unheld.update(h.request_id for h in holds)
            self._ready.set()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvRelayMetadata)
        if self.decode is None or not (meta.loads or meta.aborts or meta.give_back):
            return
        Side = DecodeSide | MappedDecode
        loads: dict[Side, list[LoadSpec]] = {self.decode: []}
        give_back: dict[Side, list[dict[str, Any]]] = {self.decode: []}
        for spec in meta.loads:
            loads.setdefault(self._decode_for(spec.params), []).append(spec)
        for params in meta.give_back:
            give_back.setdefault(self._decode_for(params), []).append(params)
        # Every side gets every abort: one that has no load of that request ignores it.
        sides: list[Side] = [self.decode, *self._mapped.values()]
        for side in sides:
            if loads.get(side) or give_back.get(side) or meta.aborts:
                side.start(loads.get(side, ()), meta.aborts, give_back.get(side, ()))

    def _decode_for(self, params: dict[str, Any]) -> DecodeSide | MappedDecode:
        """The side that pulls (or gives back) these params' leases: ours, or for a
        prefill engine of another tensor-parallel size (which the scheduler accepted)
        the sides mapping its ranks' heads onto ours, built at its first load."""
        assert self.decode is not None
        p_workers = mapped_size(params, self.tp_size, self._heads, self.settings.kv_transport)
        if p_workers is None or self._mapping is None:
            return self.decode
        mapped = self._mapped.get(p_workers)
        if mapped is None:
            mapping = self._mapping
            try:
                mapped = self._mapped[p_workers] = run_on_relay_cpus(
                    self.settings, lambda: mapping(p_workers))
            except Exception:  # those loads fail on our side (compat): vLLM recomputes
                log.exception("kvrelay: no decode side for prefill engines of %d "
                              "tensor-parallel workers", p_workers)
                return self.decode
        return mapped

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # decode engines pull from the blocks in place

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._connector_metadata
        if isinstance(meta, KvRelayMetadata) and meta.idle and self.settings.idle_step_ms:
            # An empty step (vLLM keeps stepping while a lease is held or D waits for
            # KV): wait for a report, a bounded while, instead of spinning the loop.
            self._ready.wait(self.settings.idle_step_ms / 1000)
        self._ready.clear()
        out = KVConnectorTransferResults()
        if self.prefill is not None:
            out.finished_sending = self.prefill.take_released()
        if self._unheld:
            out.finished_sending = (out.finished_sending or set()) | self._unheld
            self._unheld = set()
        if self.decode is not None:
            out.finished_recving, out.failed_recving = self.decode.take_finished()
            for mapped in self._mapped.values():
                done, failed = mapped.take_finished()
                out.finished_recving |= done
                out.failed_recving |= failed
        return out

    def get_kv_connector_stats(self) -> KvRelayStats | None:
        """Worker: pulls, fallbacks, fence refusals and lease ends since the last call
        (the scheduler side has none)."""
        stats = KvRelayStats()
        for side in (self.prefill, self.decode, *self._mapped.values()):
            if side is not None:
                side.collect_stats(stats.data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvRelayStats:
        return KvRelayStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        """``vllm:kvrelay_*`` on vLLM's /metrics (kvrelay/vllm/prom.py)."""
        from kvrelay.vllm.prom import KvRelayPromMetrics

        return KvRelayPromMetrics(vllm_config, metric_types, labelnames,
                                  per_engine_labelvalues)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def shutdown(self) -> None:
        for side in (self.prefill, self.decode, *self._mapped.values()):
            if side is not None:
                side.close()

    # ==== scheduler ========================================================================
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Every tensor-parallel worker's relay, by rank. P names one lease per rank;
        with a rank missing it names none (the request is answered without params)."""
        got = {int(r): m for r, m in metadata.items() if isinstance(m, KvRelayHandshake)}
        if sorted(got) != list(range(self.tp_size)):
            if got or self.producer:
                log.error("kvrelay: relay handshakes from workers %s, expected one from "
                          "each of the %d tensor-parallel ranks: no leases will be made",
                          sorted(got), self.tp_size)
            self._handshakes = []
            return
        self._handshakes = [got[r] for r in range(self.tp_size)]

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        if self._lease_of(request) is None:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or self._lease_of(request) is None:
            return
        params = request.kv_transfer_params
        assert params is not None
        prompt = list(request.prompt_token_ids or ())
        need = math.ceil(len(prompt) / self.block_size)
        block_ids = list(blocks.get_block_ids()[0][:need])
        cached = (len(prompt) - num_external_tokens) // self.block_size
        params[_LOADED] = True  # one load per request: a preempted one recomputes
        rid = request.request_id
        self._meta.loads.append(LoadSpec(rid, dict(params), prompt, block_ids, cached))
        self._loading[rid] = request

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KvRelayMetadata()
        meta.idle = (scheduler_output.total_num_scheduled_tokens == 0 and not meta.loads
                     and not meta.aborts and not meta.give_back and not meta.holds)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_recving or ():
            self._loading.pop(rid, None)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if self._loading.get(rid) is request:
            # Finished (aborted) while its load is in the worker: the blocks stay until
            # the worker reports the load ended (the transfer no longer writes).
            self._meta.aborts.append(rid)
            return True, None
        params = request.kv_transfer_params or {}
        if self.consumer and "lease_id" in params and not params.get(_LOADED):
            # Ended before its load was queued (aborted while waiting, or the duplicate
            # of vLLM's rejection path, whose prompt is [0]): P frees the lease now, not
            # at its timeout (a lease another request of ours pulls refuses the ABORT).
            params[_LOADED] = True
            self._meta.give_back.append(dict(params))
            return False, None
        if not (self.producer and params.get("do_remote_decode") and block_ids):
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status is not RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # aborted, failed or stopped: the client has it all
        hss = self._handshakes
        if not hss:  # no lease: vLLM frees, the proxy sees no params
            log.error("kvrelay: no lease for %s: the workers sent no relay handshake (is "
                      "kv_role a producer?)", rid)
            return False, None
        # Each worker makes its lease with the next step; until then an ACQUIRE for it
        # is answered NOT_YET. vLLM holds the request until finished_sending names it
        # from every worker (each worker's lease ends once). The id: the worker's life,
        # a sequence number (a worker makes them in order, so an ACQUIRE naming one
        # past the last made is NOT_YET) and 128 random bits (a lease id is a
        # capability: nobody may guess the next one).
        try:
            prompt = list(request.prompt_token_ids or ())
            seq = next(self._lease_seq)
            lease_ids = [f"{hs.engine_id}.{seq}.{secrets.token_hex(16)}" for hs in hss]
            first = int(request.output_token_ids[0])
            digest = prompt_digest(prompt)
            holds = [HoldSpec(rid, lid, list(block_ids), len(prompt), first, digest)
                     for lid in lease_ids]
            hs = hss[0]
            params_out = dict(
                KvTransferParams(lease_ids[0], hs.relay, hs.engine_id, list(block_ids),
                                 len(prompt), first, hs.compat).to_dict(),
                do_remote_prefill=True, do_remote_decode=False, resends_first_token=True,
                block_size=self.block_size)
            if len(hss) > 1:  # rank 0's lease above, every rank's here
                params_out["ranks"] = [
                    {"lease_id": lid, "relay": h.relay, "engine_id": h.engine_id,
                     "compat": h.compat} for lid, h in zip(lease_ids, hss, strict=True)]
        except Exception:  # no lease: vLLM frees, the proxy sees no params
            log.exception("kvrelay: no lease for %s", rid)
            return False, None
        self._meta.holds.extend(holds)  # last: a hold exists only with delay_free=True
        return True, params_out

    # -- helpers ------------------------------------------------------------------------
    def _lease_of(self, request: Request) -> RemoteKv | None:
        """The request's lease params, validated in full; None when it has none, when
        its load was queued already, or when they are refused (then vLLM prefills it
        here: vLLM gives a connector no way to answer the client 400, and P is told
        ABORT at once so it frees the lease)."""
        params = request.kv_transfer_params
        if not (self.consumer and params and "lease_id" in params) or params.get(_LOADED):
            return None
        try:
            kv = RemoteKv.from_client(params, vocab_size=self.vocab_size)
            entries = rank_entries(params)
            refused = p_ranks_refused(len(entries), self.tp_size, self._heads,
                                      self.settings.kv_transport)
            if refused:
                raise ValueError(refused)
            for entry in entries:  # every rank's lease, relay and compat
                relay = RemoteKv.from_client(entry, vocab_size=self.vocab_size).relay
                if not trusts(self.settings, relay):
                    raise ValueError(UNTRUSTED.format(relay=relay))
            p_block = params.get("block_size", self.block_size)
            if p_block != self.block_size:
                raise ValueError(
                    f"block_size: the prefill engine's blocks hold {p_block!r} tokens, this "
                    f"engine's {self.block_size}: start both with the same --block-size")
            n = len(request.prompt_token_ids or ())
            if kv.num_tokens != n:
                raise ValueError(f"num_tokens {kv.num_tokens}: the prompt has {n} tokens")
            if len(kv.block_ids) < math.ceil(n / self.block_size):
                raise ValueError(f"block_ids: {len(kv.block_ids)} blocks cannot hold {n} "
                                 f"tokens in blocks of {self.block_size}")
        except ValueError as e:
            log.warning("kvrelay: request %s: kv_transfer_params refused (%s): prefilling "
                        "here", request.request_id, e)
            params[_LOADED] = True
            self._meta.give_back.append(dict(params))  # sent only to a relay D trusts
            return None
        return kv


def _backend_name(vllm_config: Any, layer_names: list[str] | None = None) -> str:
    """The attention backend's name of ``layer_names`` (all layers: None), part of the
    layout HELLO checks; '' where vLLM cannot tell (no attention layers registered: its
    own tests and kvrelay's)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        backends = get_current_attn_backends(vllm_config, layer_names)
        names = sorted({b.get_name() for b in backends})
    except Exception as e:  # an older vLLM, or no layers: the layout says so
        log.debug("kvrelay: no attention backend name (%s)", e)
        return ""
    return ",".join(names)


def _groups_refused(vllm_config: Any, kv_cache_config: Any) -> str:
    """Why an engine with several KV cache groups cannot start, naming the model type
    and each group's kind. vLLM turns its hybrid allocator off for a connector that is
    not ``SupportsHMA`` (this one), so sliding-window models run with one group (full
    KV for every layer) and hybrid SSM models are refused by vLLM itself; several groups
    reach here only from what keeps them anyway (a drafter with layers of its own kind)."""
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    model_type = getattr(hf, "model_type", None) or "unknown"
    kinds = [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]
    return (f"KvRelayConnector moves one KV cache group; this engine's model (model_type "
            f"{model_type!r}) has {len(kinds)}: {', '.join(kinds)}. Sliding-window and "
            f"hybrid (SSM) layers in groups of their own are not served yet")


def _worker_heads(vllm_config: Any, kv_cache_config: Any) -> int:
    """A worker's KV heads: its cache group's (what the worker allocates), else the
    model's at this engine's tensor-parallel size."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    heads = getattr(groups[0].kv_cache_spec, "num_kv_heads", None) if groups else None
    if heads is None:
        heads = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
    return int(heads)


def _worker_index(vllm_config: Any) -> tuple[int, int]:
    """(tensor-parallel rank, this worker's index among the relays of the host's
    engines: data-parallel index x tensor-parallel size + rank), which a fixed
    relay_port is offset by."""
    pc = vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    rank = 0
    if tp > 1:
        from vllm.distributed.parallel_state import get_tp_group

        rank = int(get_tp_group().rank_in_group)
    dp = int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)
    return rank, dp * tp + rank


def _check_reachable(relay: str) -> None:
    """P's start-up self-check: the relay address the params will name answers here
    (a wrong relay_host otherwise shows only as every request recomputing on D)."""
    host, _, port = relay.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
    except OSError as e:
        log.error("kvrelay: the relay address %s (relay_host, relay_port) does not answer "
                  "from this host (%s): decode engines will fall back to recompute", relay, e)


def _ranges(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
