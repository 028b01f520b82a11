"""vLLM's own schedulers (``Scheduler`` and ``AsyncScheduler``) driving KvRelayConnector,
in one process, with no model: the proof that the connector can never hand vLLM a
report it cannot take, run inside the vLLM it ships for.

Two engines, P (kv_producer) and D (kv_consumer), each a real vLLM scheduler (its
connector's scheduler side built by vLLM itself) and a worker of ours: KV caches as
CPU tensors, the connector's real worker side (relay server, receiver, tcp transport
over localhost), and a "model" that writes a known value per (token, position, layer)
into the blocks of the tokens it computes and samples a token that depends only on
the sequence. A router plays the proxy: P with ``do_remote_decode``, then D with P's
params. Each seed draws its scenario: step order between P and D (so D's ACQUIRE often
beats P's worker making the lease: NOT_YET), aborts of P and of D at every step
boundary (while the lease is held, while D waits, loads, decodes), params never sent to
D (the lease expires), replayed and refused params (another length, another block
size), pulls racing lease expiry (a short lease timeout, a held-back copy, D asked
late), an exception injected into one connector thread (hold, submit, reply), P or D
restarted with live leases, and on vLLM 0.34 ``--max-num-inflight-kv-loads``.

At the end of each seed: no exception from vLLM (its ``assert req_id in
self.requests`` included), every ``finished_sending`` and ``finished_recving`` named
exactly once and only for a request that was handed over, both block pools whole, no
request, lease, load or quarantine left, and every request that computed on received
KV found in its blocks the values P wrote for its tokens. Prints one JSON line.

    PYTHONPATH=. $VLLM_VENV/bin/python -m tests.vllm.harness --seeds 20
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import vllm
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvrelay.vllm import connector as connector_module
from kvrelay.vllm import faults
from kvrelay.vllm.api import KVConnectorRole
from kvrelay.vllm.connector import KvRelayConnector, KvRelayMetadata
from kvrelay.vllm.decode import RANK_FIELDS

MODEL = os.environ.get("KVRELAY_VLLM_MODEL", "/tmp/kvrelay-vllm/smollm2-135m-hf")
BLOCK, NUM_BLOCKS, LAYERS, HEADS, HEAD, VOCAB = 16, 96, 2, 2, 8, 1000
MAX_LEN = 512


def kv_value(token: int, pos: int, layer: int, head: int = 0) -> float:
    """The KV of KV head ``head`` of the model (a worker of tensor-parallel rank ``r``
    with ``h`` heads holds heads ``r*h .. r*h+h-1``: P and D of different sizes agree
    on a head's values)."""
    return float((token * 131 + pos * 17 + layer * 7) % 4093 + 1 + 5000 * head)


def next_token(tokens: list[int]) -> int:
    tail = tokens[-8:]
    return (sum(t * (i + 3) for i, t in enumerate(tail)) + 7 * len(tokens)) % VOCAB


def expected(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def sampling(max_tokens: int, kv_transfer_params: dict[str, Any]) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"kv_transfer_params": kv_transfer_params})


INFLIGHT = "max_num_inflight_kv_loads" in SchedulerConfig.__dataclass_fields__  # 0.34


def make_config(role: str, extra: dict[str, Any], sched_cls: type[Scheduler],
                inflight: int | None = None, tp: int = 1) -> VllmConfig:
    # device "cpu": without a GPU vLLM 0.34's platform is unspecified and "auto" fails.
    cfg = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(model=MODEL, dtype="float32", seed=0, max_model_len=MAX_LEN,
                                 skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=MAX_LEN, max_model_len=MAX_LEN,
            is_encoder_decoder=False,
            **({"max_num_inflight_kv_loads": inflight} if inflight else {})),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvRelayConnector", kv_connector_module_path="kvrelay.vllm",
            kv_role=role, kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra),
    )
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    # Tensor parallelism: the schedulers see the size; the workers are ours (Engine).
    cfg.parallel_config.tensor_parallel_size = tp
    # vLLM's CPU platform turns async scheduling off; the engine core would turn it on
    # with AsyncScheduler (a consumer then defers freeing blocks, as on a GPU).
    cfg.scheduler_config.async_scheduling = sched_cls is AsyncScheduler
    return cfg


def make_kv_cache_config(heads: int = HEADS) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD,
                             dtype=torch.float32)
    names = [f"layer.{i}" for i in range(LAYERS)]
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=page * NUM_BLOCKS, shared_by=[n])
                          for n in names]
        if "shared_by" in KVCacheTensor.__dataclass_fields__ else
        [KVCacheTensor(size=page * NUM_BLOCKS, layers=names, layer_stride=page * NUM_BLOCKS,
                       block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


class Engine:
    """One vLLM scheduler and model-less workers (one per tensor-parallel rank, each
    its own KV cache: its heads) holding the connector's worker side; vLLM's own
    ``KVOutputAggregator`` combines the workers' reports, as its executor does."""

    def __init__(self, name: str, config: VllmConfig, sched_cls: type[Scheduler],
                 heads: int = HEADS, p_tp: int = 0) -> None:
        """``heads``: each worker's KV heads; ``p_tp``: a decode engine's prefill
        engine's tensor-parallel size, where it differs (heterogeneous TP)."""
        self.name = name
        self.heads = heads
        kv_cfg = make_kv_cache_config(heads)
        self.sched = sched_cls(vllm_config=config, kv_cache_config=kv_cfg,
                               structured_output_manager=StructuredOutputManager(config),
                               block_size=BLOCK, log_stats=True)
        assert isinstance(self.sched.connector, KvRelayConnector), self.sched.connector
        self.depth = 2 if sched_cls is AsyncScheduler else 1  # steps in flight
        tp = config.parallel_config.tensor_parallel_size
        self.workers: list[KvRelayConnector] = []
        self.caches: list[dict[str, torch.Tensor]] = []
        where = connector_module._worker_index
        try:
            for rank in range(tp):
                # What vLLM's tensor-parallel group tells a worker process of its rank.
                connector_module._worker_index = lambda _cfg, r=rank: (r, r)  # type: ignore[assignment]
                worker = KvRelayConnector(config, KVConnectorRole.WORKER, kv_cfg)
                storage = torch.zeros(LAYERS, NUM_BLOCKS, heads, BLOCK, 2 * HEAD)
                cache = {f"layer.{i}": storage[i] for i in range(LAYERS)}
                worker.register_kv_caches(cache)
                if p_tp and p_tp != tp:  # its sides pulling P's ranks, built now
                    worker._decode_for({"ranks": [dict.fromkeys(RANK_FIELDS, "")] * p_tp})
                self.workers.append(worker)
                self.caches.append(cache)
        finally:
            connector_module._worker_index = where  # type: ignore[assignment]
        self.worker, self.cache = self.workers[0], self.caches[0]
        self.aggregator = KVOutputAggregator(tp)
        hs = {r: w.get_handshake_metadata() for r, w in enumerate(self.workers)}
        if all(h is not None for h in hs.values()):
            self.sched.connector.set_xfer_handshake_metadata(hs)
        self.worker_sending = [collections.Counter[str]() for _ in range(tp)]
        self.worker_recving = [collections.Counter[str]() for _ in range(tp)]
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.in_flight: collections.deque[tuple[Any, ModelRunnerOutput]] = collections.deque()
        self.sending: collections.Counter[str] = collections.Counter()
        self.recving: collections.Counter[str] = collections.Counter()
        self.loads: collections.Counter[str] = collections.Counter()  # loads handed over
        self.violations: list[str] = []
        self.steps = 0

    # -- the model runner's part --------------------------------------------------------
    def execute(self, so: Any) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
            self.tokens.pop(rid, None)
        starts: dict[str, int] = {}
        checks: list[str] = []  # first computed on blocks they did not write themselves
        for nr in so.scheduled_new_reqs:
            self.tables[nr.req_id] = list(nr.block_ids[0])
            self.tokens[nr.req_id] = list(nr.prompt_token_ids)
            starts[nr.req_id] = nr.num_computed_tokens
            checks.append(nr.req_id)
        cd = so.scheduled_cached_reqs
        resumed = getattr(cd, "resumed_req_ids", ())  # 0.34 sends them as new requests
        for i, rid in enumerate(cd.req_ids):
            new = cd.new_block_ids[i]
            if rid in resumed:
                self.tables[rid] = list(new[0]) if new else []
                checks.append(rid)
            elif new:
                self.tables[rid].extend(new[0])
            starts[rid] = cd.num_computed_tokens[i]
        meta = so.kv_connector_metadata
        assert isinstance(meta, KvRelayMetadata)
        for spec in meta.loads:
            self.loads[spec.request_id] += 1
        for worker in self.workers:  # vLLM hands every worker the step's metadata
            worker.bind_connector_metadata(meta)  # P's workers make the named leases
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for rid, n in so.num_scheduled_tokens.items():
            toks, table, start = self.tokens[rid], self.tables[rid], starts[rid]
            for pos in range(start, start + n):
                for layer in range(LAYERS):
                    for rank, cache in enumerate(self.caches):
                        for h in range(self.heads):
                            cache[f"layer.{layer}"][table[pos // BLOCK], h, pos % BLOCK, :] = (
                                kv_value(toks[pos], pos, layer, rank * self.heads + h))
            req_ids.append(rid)
            if start + n >= len(toks):
                t = next_token(toks)
                toks.append(t)
                sampled.append([t])
            else:
                sampled.append([])  # a chunk of the prompt
        # After the step's writes: a prefix-cache hit on blocks another request of the
        # same step computes is read after that request wrote them (as attention does).
        for rid in checks:
            self.check(rid, starts[rid])
        kw: dict[str, Any] = {}
        if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # 0.32
            kw["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        outputs: list[ModelRunnerOutput | None] = []
        for rank, worker in enumerate(self.workers):
            # vLLM starts loads after the forward pass when none is synchronous (ours).
            worker.start_load_kv(None)  # type: ignore[arg-type]
            res = worker.get_transfer_results(so.finished_req_ids)
            self.worker_sending[rank].update(res.finished_sending or ())
            self.worker_recving[rank].update(res.finished_recving or ())
            out = KVConnectorOutput(finished_sending=res.finished_sending,
                                    finished_recving=res.finished_recving,
                                    failed_recving=res.failed_recving,
                                    kv_connector_stats=worker.get_kv_connector_stats())
            worker.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(req_ids=list(req_ids),
                                             sampled_token_ids=list(sampled),
                                             kv_connector_output=out, **kw))
        mro = self.aggregator.aggregate(outputs) if len(outputs) > 1 else outputs[0]
        assert mro is not None and mro.kv_connector_output is not None
        kout = mro.kv_connector_output
        self.sending.update(kout.finished_sending or ())
        self.recving.update(kout.finished_recving or ())
        return mro

    def check(self, rid: str, computed: int) -> None:
        """The tokens vLLM counts as computed hold their KV (received, cached or ours),
        on every rank its own heads'."""
        toks, table = self.tokens[rid], self.tables[rid]
        for pos in range(computed):
            for layer in range(LAYERS):
                for rank, cache in enumerate(self.caches):
                    for h in range(self.heads):
                        got = cache[f"layer.{layer}"][table[pos // BLOCK], h, pos % BLOCK, 0]
                        if float(got) != kv_value(toks[pos], pos, layer,
                                                  rank * self.heads + h):
                            self.violations.append(
                                f"{self.name}: {rid} position {pos} layer {layer} rank "
                                f"{rank} head {h}: KV {float(got)} is not its token's")
                            return

    # -- the engine core's part ------------------------------------------------------------
    def step(self) -> list[Any]:
        """One engine step (with async scheduling the output of the step before is
        applied after this one is scheduled). Returns the step's EngineCoreOutputs."""
        if not self.sched.has_requests() and not self.in_flight:
            return []
        self.steps += 1
        so = self.sched.schedule()
        self.in_flight.append((so, self.execute(so)))
        outs: list[Any] = []
        while self.in_flight and (len(self.in_flight) >= self.depth
                                  or so.total_num_scheduled_tokens == 0):
            done_so, mro = self.in_flight.popleft()
            for eco in self.sched.update_from_output(done_so, mro).values():
                outs.extend(eco.outputs)
        return outs

    def leftovers(self) -> list[str]:
        bad = []
        pool = self.sched.kv_cache_manager.block_pool
        if self.sched.requests:
            bad.append(f"{self.name}: requests left {sorted(self.sched.requests)}")
        if pool.get_num_free_blocks() != NUM_BLOCKS - 1:
            bad.append(f"{self.name}: {NUM_BLOCKS - 1 - pool.get_num_free_blocks()} blocks "
                       "not back in vLLM's pool")
        if getattr(self.sched, "_aborted_kv_loads", None):  # 0.34: each holds a load slot
            bad.append(f"{self.name}: aborted loads never reported "
                       f"{sorted(self.sched._aborted_kv_loads)}")
        counters = (self.sending, self.recving, *self.worker_sending, *self.worker_recving)
        twice = [r for c in counters for r, n in c.items() if n > 1]
        if twice:
            bad.append(f"{self.name}: reported twice: {twice}")
        for rank, worker in enumerate(self.workers):
            if worker.prefill is not None and worker.prefill.table.leases:
                bad.append(f"{self.name}: rank {rank}: leases left "
                           f"{list(worker.prefill.table.leases)}")
            if worker.prefill is not None and set(self.worker_sending[rank]) != set(
                    self.sending):
                mine = sorted(self.worker_sending[rank])
                bad.append(f"{self.name}: rank {rank} reported {mine}, vLLM freed "
                           f"{sorted(self.sending)}")
            for d in sides(worker):
                if d.receiver.loads or d.loads.quarantined:
                    bad.append(f"{self.name}: rank {rank}: loads left {list(d.receiver.loads)}"
                               f" quarantined {list(d.loads.quarantined)}")
            if worker.decode is not None and set(self.worker_recving[rank]) != set(self.loads):
                bad.append(f"{self.name}: rank {rank}: loads {sorted(self.loads)} "
                           f"reported {sorted(self.worker_recving[rank])}")
        if self.worker.decode is not None and set(self.recving) != set(self.loads):
            bad.append(f"{self.name}: loads {sorted(self.loads)}, vLLM was told "
                       f"{sorted(self.recving)}")
        return bad

    def decoders(self) -> list[Any]:
        return [d for w in self.workers for d in sides(w)]

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.sched.shutdown()


def sides(worker: KvRelayConnector) -> list[Any]:
    """A worker's decode sides: its own and those pulling from a P of more workers."""
    own = [] if worker.decode is None else [worker.decode]
    return own + [s for m in worker._mapped.values() for s in m.sides]


@dataclass
class Flow:
    """One client request through the router: P, then D."""

    i: int
    prompt: list[int]
    max_tokens: int
    abort_p_after: int | None = None  # engine steps after P got it
    abort_d_after: int | None = None  # engine steps after D got it
    skip_d: bool = False  # the proxy never sends D the params: P's lease expires
    replay: bool = False  # a second D request with the same params
    corrupt: str = ""  # params D refuses: num_tokens off by one, or another block_size
    d_wait_s: float = 0.0  # wall-clock wait before D gets the params
    p_steps: int = 0
    d_steps: dict[str, int] = field(default_factory=dict)
    params: dict[str, Any] | None = None
    params_at: float = 0.0
    p_done: bool = False
    p_lost: bool = False  # its P engine restarted before it finished
    d_pending: list[str] = field(default_factory=list)  # D request ids not finished
    d_sent: bool = False


def scenario(rng: random.Random, n: int) -> tuple[list[Flow], dict[str, Any]]:
    lease_timeout = rng.choice([0.3, 1.0, 30.0])
    knobs = {"lease_timeout": lease_timeout,
             "transfer_delay": rng.choice([0.0, 0.0, 0.05, 0.3 * lease_timeout]),
             "fault": rng.choice([None] * 6 + [f"hold:{rng.randint(1, n)}",
                                               f"submit:{rng.randint(1, n)}",
                                               f"reply:{rng.randint(1, 2 * n)}"]),
             "order": rng.choice(["both", "random", "d_first"]),
             # vLLM 0.34: loads admitted while the batch is full, at most this many
             "inflight": rng.choice([None, 2]) if INFLIGHT else None,
             # an engine restarted with live leases, after this many loop turns (D only
             # with short leases: P frees what D held at their timeout)
             "restart": rng.choice([None] * 4 + ["p"] + (["d"] if lease_timeout < 2 else [])),
             "restart_at": rng.randint(2, 12)}
    shared = [rng.randrange(VOCAB) for _ in range(BLOCK * 2)]  # a prefix many prompts share
    flows = []
    for i in range(n):
        body = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 60))]
        prompt = (shared[:rng.choice([0, BLOCK, 2 * BLOCK])] + body)[:MAX_LEN - 16]
        f = Flow(i, prompt, rng.randint(1, 6))
        r = rng.random()
        if r < 0.12:
            f.abort_p_after = rng.randint(0, 3)
        elif r < 0.20 and lease_timeout < 2:
            f.skip_d = True
        elif r < 0.50:
            f.abort_d_after = rng.randint(0, 8)
        f.replay = rng.random() < 0.08
        if rng.random() < 0.08:
            f.corrupt = rng.choice(["num_tokens", "block_size"])
        if lease_timeout < 2 and rng.random() < 0.3:
            f.d_wait_s = rng.uniform(0.5, 1.5) * lease_timeout  # around the expiry
        flows.append(f)
    return flows, knobs


def run_seed(seed: int, sched_cls: type[Scheduler], hasher: Any, n: int,
             limit_s: float = 60.0, tp: tuple[int, int] = (1, 1)) -> dict[str, Any]:
    """``tp``: P's and D's tensor-parallel sizes (each worker of the larger one holds
    ``HEADS`` KV heads)."""
    rng = random.Random(seed)
    flows, knobs = scenario(rng, n)
    faults._counts.clear()
    if knobs["fault"]:
        os.environ["KVRELAY_FAULT_VLLM_RAISE"] = knobs["fault"]
    else:
        os.environ.pop("KVRELAY_FAULT_VLLM_RAISE", None)
    extra = {"lease_timeout": knobs["lease_timeout"], "idle_step_ms": 1}
    p_tp, d_tp = tp
    model_heads = HEADS * max(tp)

    def new_p() -> Engine:
        return Engine("P", make_config("kv_producer", extra, sched_cls, tp=p_tp), sched_cls,
                      model_heads // p_tp)

    def new_d() -> Engine:
        return Engine("D", make_config("kv_consumer", extra, sched_cls, knobs["inflight"],
                                       d_tp), sched_cls, model_heads // d_tp, p_tp)

    p, d = new_p(), new_d()
    for dec in d.decoders():
        dec.transport.delay = knobs["transfer_delay"]
    stats = collections.Counter[str]()
    by_d: dict[str, Flow] = {}
    d_out: dict[str, list[int]] = {}
    deadline = time.monotonic() + limit_s
    retired: list[Engine] = []  # engines that "died" mid-seed (closed)
    turn = 0
    try:
        for f in flows:
            p.sched.add_request(Request(
                f"p{f.i}", f.prompt, sampling(1, {"do_remote_decode": True}), None,
                block_hasher=hasher))
        while True:
            if time.monotonic() > deadline:
                pending = {f"p{f.i}": (f.p_done, f.d_sent, f.d_pending) for f in flows
                           if not ((f.p_done or f.abort_p_after is not None)
                                   and not f.d_pending)}
                raise TimeoutError(f"the seed did not settle in {limit_s:g} s: flows "
                                   f"{pending}; P has {sorted(p.sched.requests)}, D has "
                                   f"{sorted(d.sched.requests)}")
            turn += 1
            if knobs["restart"] == "p" and turn == knobs["restart_at"]:
                # P dies with live leases (some held, some being pulled): its clients
                # get errors; params it handed out name a relay that is gone.
                retired.append(p)
                p.close()
                p = new_p()
                for f in flows:
                    f.p_lost = not f.p_done and f.abort_p_after is None
                stats["p_restarted"] += 1
            elif knobs["restart"] == "d" and turn == knobs["restart_at"]:
                # D dies mid-pull: P must free what D held (at the lease timeout).
                retired.append(d)
                d.close()
                d = new_d()
                for dec in d.decoders():
                    dec.transport.delay = knobs["transfer_delay"]
                for f in by_d.values():
                    f.d_pending.clear()
                stats["d_restarted"] += 1
            order = knobs["order"]
            step_p = order == "both" or (order == "random" and rng.random() < 0.5) or (
                order == "d_first" and rng.random() < 0.3)
            if step_p:
                for out in p.step():
                    f = flows[int(out.request_id[1:])]
                    if out.finish_reason is not None and not f.p_lost:
                        f.p_done = True
                        f.params, f.params_at = out.kv_transfer_params, time.monotonic()
            for f in flows:
                f.p_steps += 1
                if f.abort_p_after is not None and f.p_steps == f.abort_p_after + 1 \
                        and not f.p_done:
                    p.sched.finish_requests(f"p{f.i}", RequestStatus.FINISHED_ABORTED)
                    stats["p_aborted"] += 1
                if (f.params and not f.d_sent and not f.skip_d
                        and time.monotonic() >= f.params_at + f.d_wait_s):
                    f.d_sent = True
                    params = dict(f.params)
                    if f.corrupt == "num_tokens":
                        params["num_tokens"] += 1
                    elif f.corrupt == "block_size":
                        params["block_size"] = 2 * BLOCK
                    for k in range(2 if f.replay else 1):
                        rid = f"d{f.i}.{k}"
                        by_d[rid] = f
                        f.d_pending.append(rid)
                        f.d_steps[rid] = 0
                        d.sched.add_request(Request(
                            rid, f.prompt, sampling(f.max_tokens, dict(params)), None,
                            block_hasher=hasher))
            for out in d.step():
                f = by_d[out.request_id]
                d_out.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    f.d_pending.remove(out.request_id)
                    if out.finish_reason.name != "ABORT":
                        got, want = d_out[out.request_id], expected(f.prompt, f.max_tokens)
                        if got != want:
                            d.violations.append(f"{out.request_id}: tokens {got} != {want}")
            for rid, f in list(by_d.items()):
                if rid in f.d_pending:
                    f.d_steps[rid] += 1
                    if f.abort_d_after is not None and f.d_steps[rid] == f.abort_d_after + 1:
                        load = next((x.receiver.loads[rid] for x in d.decoders()
                                     if rid in x.receiver.loads), None)
                        req = d.sched.requests.get(rid)
                        where = (load.phase.value if load is not None else
                                 req.status.name.lower() if req is not None else "gone")
                        d.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                        f.d_pending.remove(rid)
                        stats[f"d_aborted_{where}"] += 1
            settled = all(
                (f.p_done or f.abort_p_after is not None or f.p_lost) and not f.d_pending
                and (f.d_sent or f.skip_d or not f.params) for f in flows)
            if settled and not p.sched.has_requests() and not d.sched.has_requests() \
                    and not p.in_flight and not d.in_flight:
                break
        # vLLM has every report; the receiver may still await P's answer to the last
        # RELEASE or ABORT it sent (bounded by its peer timeout).
        settle = time.monotonic() + knobs["lease_timeout"] + 5
        while any(x.receiver.loads for x in d.decoders()) and time.monotonic() < settle:
            time.sleep(0.01)
        problems = p.violations + d.violations + p.leftovers() + d.leftovers()
        for old in retired:  # up to its death, each report once
            problems += old.violations + [
                f"{old.name} (before its restart): reported twice: {r}"
                for c in (old.sending, old.recving) for r, k in c.items() if k > 1]
        decs = d.decoders()
        stats.update(pulls=sum(x.receiver.stats.loaded for x in decs), requests=len(flows),
                     not_yet=sum(x.receiver.stats.not_yet for x in decs),
                     fallbacks=sum(sum(x.receiver.stats.fallbacks.values()) for x in decs),
                     leases=len(p.sending), loads=len(d.loads),
                     errors=sum(x.errors for x in decs))
        for x in decs:
            for why, k in x.receiver.stats.fallbacks.items():
                stats[f"fallback_{why}"] += k
        return {"seed": seed, "problems": problems, "stats": dict(stats), "knobs": knobs}
    except Exception as e:
        return {"seed": seed, "problems": [f"{type(e).__name__}: {e}",
                                           traceback.format_exc(limit=6)],
                "stats": dict(stats), "knobs": knobs}
    finally:
        p.close()
        d.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--limit", type=float, default=60.0, help="seconds a seed may take")
    ap.add_argument("--scheduler", choices=["sync", "async", "both"], default="both")
    ap.add_argument("--tp", default="1", help="tensor-parallel workers per engine: N, or "
                    "P:D for a prefill and a decode engine of different sizes")
    args = ap.parse_args()
    p_tp, _, d_tp = args.tp.partition(":")
    tp = (int(p_tp), int(d_tp or p_tp))
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    kinds = {"sync": [Scheduler], "async": [AsyncScheduler],
             "both": [Scheduler, AsyncScheduler]}[args.scheduler]
    total: collections.Counter[str] = collections.Counter()
    failed: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for cls in kinds:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            t = time.monotonic()
            res = run_seed(seed, cls, hasher, args.requests, args.limit, tp)
            print(f"seed {seed} {cls.__name__}: {time.monotonic() - t:.1f} s, "
                  f"{len(res['problems'])} problems", file=sys.stderr, flush=True)
            total.update(res["stats"])
            total[f"seeds_{cls.__name__}"] += 1
            if res["problems"]:
                failed.append(dict(res, scheduler=cls.__name__))
    print(json.dumps({"vllm": vllm.__version__, "tp": tp[0] if tp[0] == tp[1] else args.tp,
                      "seconds": round(time.monotonic() - t0, 1),
                      "totals": dict(sorted(total.items())), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
