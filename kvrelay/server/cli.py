"""``kvrelay serve [MODEL]``: the OpenAI-compatible server on one colocated engine.

Flags follow vLLM's names. The model, the engine and the app are built by
``build_state`` so that other commands (the demo, later the prefill/decode roles)
build the same way.
"""

from __future__ import annotations

import argparse
import atexit
import logging
from typing import TYPE_CHECKING, Any

from kvrelay import env
from kvrelay.errors import EXIT_FAILURE, UsageError
from kvrelay.model.kernels import choice as kernel_choice

if TYPE_CHECKING:
    from kvrelay.model.interface import LoadedModel
    from kvrelay.server.api import ServerState

log = logging.getLogger("kvrelay.serve")

DTYPES = ("float32", "bfloat16", "float16", "auto")
# kvrelay.wire.tools' parsers (not imported here: it pulls in the grammar engine).
TOOL_PARSERS = ("hermes", "llama3_json", "mistral")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (a Hugging Face directory or a .gguf file; default: the "
        "embedded SmolLM2-135M-Instruct) over an OpenAI-compatible HTTP API.",
    )
    add_model_args(p)
    add_cache_args(p)
    add_server_args(p)
    add_role_args(p)
    p.set_defaults(func=run)


def add_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="share the KV of full blocks between requests with the "
                   "same token prefix (every role; on the decode role, not for requests whose "
                   "KV is pulled)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish the prefix cache's block stored/removed events as vLLM does "
                   "(its KVEventsConfig fields: enable_kv_cache_events, publisher \"zmq\", "
                   "endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic), e.g. "
                   "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}'")


def add_role_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregation (see docs/operations.md)")
    g.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                   help="both: one colocated engine; prefill: serve do_remote_decode requests "
                   "and lease their KV; decode: pull leased KV and decode")
    g.add_argument("--relay-host", default="127.0.0.1",
                   help="prefill: address of the relay port decode engines connect to")
    g.add_argument("--relay-port", type=int, default=0,
                   help="prefill: relay port (default: any free port, logged at start)")
    g.add_argument("--kv-transport", choices=("auto", "shm", "tcp", "cuda_ipc", "nixl"),
                   default="auto",
                   help="prefill: what to offer besides tcp (auto: shm, or cuda_ipc for a KV "
                   "cache on a GPU); decode: what to use (auto: shm, or cuda_ipc on a GPU, for "
                   "a prefill engine on this host, tcp otherwise; a GPU cache's tcp stages "
                   "through pinned host memory; nixl needs kvrelay[nixl])")
    g.add_argument("--lease-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="prefill: a lease nobody acquires (or heartbeats) is freed after this; "
                   "decode: how long to wait for a prefill engine's answer")
    g.add_argument("--lease-max", type=float, default=480.0, metavar="SECONDS",
                   help="prefill: hard cap on a lease's life, heartbeats included")
    g.add_argument("--relay-secret", default=env.get("KVRELAY_RELAY_SECRET"),
                   help="shared secret authenticating decode engines (HMAC of HELLO; env "
                   "KVRELAY_RELAY_SECRET)")
    g.add_argument("--max-awaiting-kv-blocks", type=int, default=None, metavar="BLOCKS",
                   help="decode: most KV blocks that requests waiting for pulled KV may hold "
                   "at once (default: half the pool); beyond it they queue")
    g.add_argument("--max-queued-kv-requests", type=int, default=None, metavar="N",
                   help="decode: most pulled requests queued behind --max-num-seqs and "
                   "--max-awaiting-kv-blocks (default: 4 x --max-num-seqs); one more gets "
                   "HTTP 429 with Retry-After, its lease untouched")
    g.add_argument("--kv-load-failure-policy", choices=("recompute", "fail"),
                   default="recompute", help="decode: when the KV cannot be pulled, prefill "
                   "locally (recompute) or fail the request with a clear error")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face model directory or .gguf file (default: embedded model)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights and KV dtype; auto: on a CPU bfloat16 where it computes "
                   "bf16 natively (avx512_bf16, amx_bf16), else float32, whatever the "
                   "checkpoint stores; on CUDA the checkpoint's")
    p.add_argument("--quantization", choices=["auto", "none", "gguf"], default="auto",
                   help="gguf: serve a GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights as "
                   "stored (native kernels, 8-bit activations); none: dequantize at load; auto: "
                   "gguf for a GGUF with such weights where the native kernels run, else none")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "fp8", "fp8_e4m3"],
                   help="KV cache dtype; auto: the model's (--dtype). bfloat16 under a float32 "
                   "model halves the cache's memory and the bytes a decode step reads; fp8 "
                   "(fp8_e4m3: e4m3 codes and a float16 scale per token and head, native "
                   "kernels only) takes about a quarter of float32's, half of bfloat16's")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length limit (default: the model's own)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV cache blocks (default: from --kv-cache-memory or the model)")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="memory for the KV cache in GiB (ignored with --num-blocks)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="most requests running in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens computed in one step (prefill chunks included)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule step N+1 before step N's output is applied")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (on CUDA devices they are on by "
                   "default; never used on CPU)")
    p.add_argument("--seed", type=int, default=0, help="global random seed")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice, one per core); engines "
                   "sharing a host should split the cores between them")


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=env.get("KVRELAY_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (env KVRELAY_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use; the first is reported (default: model's)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="grace period of the drain on SIGTERM/SIGINT: /health says draining, "
                   "new requests are refused (503), in-flight ones (and a prefill engine's "
                   "leases) may finish this long before they are aborted")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\": the model writes calls in its own "
                   "format, --tool-call-parser finds them (vLLM's flag)")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                   help="the model family's tool-call format for tool_choice auto: hermes "
                   "(<tool_call>...</tool_call>, SmolLM2, Qwen), llama3_json, mistral")


def build_state(args: argparse.Namespace) -> ServerState:
    """Load the model and build the engine, its loop and the app state."""
    import random

    import torch

    from kvrelay.config import SchedulerConfig
    from kvrelay.core.engine import Engine
    from kvrelay.model import load_model
    from kvrelay.model.text.detokenizer import IncrementalDetokenizer
    from kvrelay.server.api import ServedModel, ServerState
    from kvrelay.server.disagg import (
        DecodeHooks,
        PrefillHooks,
        RelayExport,
        build_decode,
        build_prefill,
    )
    from kvrelay.server.engine_loop import EngineLoop, LoopHooks
    from kvrelay.server.metrics import ServerMetrics

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    role = getattr(args, "role", "both")
    events_config = None
    if getattr(args, "kv_events_config", None):
        from kvrelay.wire.kv_events import parse_config

        events_config = parse_config(args.kv_events_config)  # ValueError: a usage error
    shm = None
    on_cpu = str(args.device).startswith("cpu")
    if role == "prefill" and args.kv_transport in ("auto", "shm") and on_cpu:
        from kvrelay.relay.transports.shm import ShmKvCache

        shm = ShmKvCache()  # decode engines on this host copy blocks straight out of it
        atexit.register(shm.close)
    model: LoadedModel = load_model(
        args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_blocks=args.num_blocks, kv_cache_memory_gb=args.kv_cache_memory,
        max_model_len=args.max_model_len, kv_cache_factory=shm.factory if shm else None,
        max_num_seqs=args.max_num_seqs, enforce_eager=getattr(args, "enforce_eager", False),
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
    )
    block_size = model.kv_geometry.block_size
    config = SchedulerConfig(
        num_blocks=model.num_blocks, block_size=block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=model.max_model_len,
        async_scheduling=args.async_scheduling,
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        prefix_cache_salt=model.kv_geometry.compat_hash(model.name),
        max_awaiting_kv_blocks=getattr(args, "max_awaiting_kv_blocks", None),
        max_queued_kv_requests=getattr(args, "max_queued_kv_requests", None),
    )
    hooks: LoopHooks | None = None
    release = None
    if role == "prefill":
        engine, prefill = build_prefill(args, config, model, shm)
        hooks, release = prefill, prefill.release
    elif role == "decode":
        engine, hooks = build_decode(args, config, model)
    else:
        engine = Engine(config, model.runner)
    tok = model.tokenizer
    names = args.served_model_name or [model.name]
    served = ServedModel(
        names=names, tokenizer=tok, max_model_len=model.max_model_len,
        max_context=min(model.max_model_len, model.num_blocks * block_size),
        make_detokenizer=lambda ids, p: IncrementalDetokenizer(
            tok, ids, stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output,
            min_tokens=p.min_tokens,
        ),
        block_size=block_size,
    )
    log.info(
        "model %s: %d KV blocks of %d tokens (%s), max_model_len %d, dtype %s, device %s",
        names[0], model.num_blocks, block_size, model.kv_geometry.dtype, model.max_model_len,
        getattr(model, "dtype", model.kv_geometry.dtype), args.device,
    )
    metrics = ServerMetrics(engine, names[0], cache_dtype=args.kv_cache_dtype)
    if isinstance(hooks, PrefillHooks | DecodeHooks):
        metrics.register(RelayExport(hooks))  # with model_name, as every engine series
    publisher = None
    if events_config is not None and events_config.enabled:
        from kvrelay.wire.kv_events import ZmqEventPublisher

        # At most one step's events wait in the core: the loop takes them every step.
        engine.record_kv_events(max(4 * model.num_blocks, 1024))
        publisher = ZmqEventPublisher(events_config)
    loop = EngineLoop(engine, hooks=hooks, threads=torch.get_num_threads(), kv_events=publisher)
    parser = args.tool_call_parser if getattr(args, "enable_auto_tool_choice", False) else None
    keys = None
    if role == "prefill":
        import time

        from kvrelay.relay.release_keys import ReleaseKeys

        # An entry older than the acquire deadline is of a lease pulled or expired.
        keys = ReleaseKeys(ttl=args.lease_timeout, clock=time.monotonic)
    return ServerState(loop, served, metrics, args.api_key, role=role, release_lease=release,
                       release_keys=keys, tool_parser=parser,
                       kv_events=publisher.advertised() if publisher is not None else None)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvrelay.server.api import create_app
    from kvrelay.wire.drain import DrainGate
    from kvrelay.wire.graceful import GracefulServer

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.api_key is None and env.set_but_empty("KVRELAY_API_KEY"):
        # Fail closed: an empty secret (a Kubernetes secret that did not populate) must
        # not serve with no key at all.
        raise UsageError("KVRELAY_API_KEY is set but empty: set a key, or unset it to "
                         "serve without one")
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise UsageError("--enable-auto-tool-choice needs --tool-call-parser "
                         f"({', '.join(TOOL_PARSERS)})")
    try:
        # The engine thread's OpenMP pool should be the only one (run_in_own_thread).
        state = kernel_choice.run_in_own_thread(lambda: build_state(args))
    except (OSError, ValueError) as exc:  # no such model, bad flag values: say which
        raise UsageError(f"cannot start: {exc}") from exc
    state.drain.grace_s = args.shutdown_timeout
    config = uvicorn.Config(
        DrainGate(create_app(state), state.drain), host=args.host, port=args.port,
        log_level=args.log_level, access_log=args.log_level == "debug",
        # The drain ends every response by shutdown_timeout; this only catches a hang.
        timeout_graceful_shutdown=5,
    )
    server = GracefulServer(config, drain=state.loop.drain, drain_after=args.shutdown_timeout,
                            state=state.drain, pending=state.loop.hooks.drain_pending)
    log.info("serving %s on http://%s:%d/v1", state.model.name, args.host, args.port)
    server.run()
    if not server.started:
        return EXIT_FAILURE  # e.g. the port was taken; uvicorn logged why
    pool = state.loop.engine.pool
    log.info("stopped; KV blocks: %d of %d free or cached%s", pool.num_free + pool.num_cached,
             pool.num_blocks, state.loop.hooks.exit_summary())
    return 0
