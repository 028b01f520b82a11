"""Decode-step time with and without decode graphs, in one run, on one model.

    python -m kvrelay.bench.graphs MODEL --device cuda --batch 1 32 256

For each batch size: prefill that many random prompts of ``--context`` tokens, then
run ``--steps`` greedy decode steps eagerly and the same steps again through the
graphs (from the same position, so they rewrite the same KV slots); prints the
milliseconds per step of each (sampling included: the step ends when its tokens
are on the host), the ratio, and whether the two runs chose the same tokens. On
CPU the graphs are the re-run stand-in (graphs.RerunGraph): a dry run of the path,
no speedup expected.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from kvrelay import env
from kvrelay.core.runner import PLACEHOLDER, Batch, ScheduledRequest
from kvrelay.model.graph_runner import cuda_capture, enable_decode_graphs
from kvrelay.model.kernels.graphs import Capture, rerun_capture
from kvrelay.model.runner import ModelRunner
from kvrelay.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode(runner: ModelRunner, reqs: list[ScheduledRequest], steps: int, step_id: int
            ) -> tuple[list[list[int]], float]:
    """``steps`` decode steps of every request from its current position; returns
    the tokens and the seconds per step."""
    dev = runner.device
    rows = [ScheduledRequest(sr.request_id, [PLACEHOLDER], sr.start, sr.block_ids, True,
                             GREEDY, sr.prompt_len) for sr in reqs]
    out: list[list[int]] = [[] for _ in reqs]
    _sync(dev)
    t0 = time.perf_counter()
    for s in range(steps):
        got = runner.execute(Batch(step_id + s, rows))
        for i, sr in enumerate(rows):
            out[i].append(got[sr.request_id].token_id)
            sr.start += 1
    _sync(dev)
    return out, (time.perf_counter() - t0) / steps


def measure(runner: ModelRunner, batch: int, context: int, steps: int, scratch: int,
            vocab: int, seed: int = 0) -> dict[str, object]:
    bs = runner.block_size
    per_seq = -(-(context + steps + 1) // bs)
    if batch * per_seq > scratch:
        raise ValueError(f"batch {batch} needs {batch * per_seq} blocks; the cache has {scratch}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(context)] for _ in range(batch)]
    reqs = [ScheduledRequest(f"b{batch}r{i}", p, 0, list(range(i * per_seq, (i + 1) * per_seq)),
                             True, GREEDY, context) for i, p in enumerate(prompts)]
    first = runner.execute(Batch(0, reqs))  # prefill (eager): each request's first token
    for sr in reqs:
        sr.start = context

    def run(n: int) -> tuple[list[list[int]], float]:
        # Every run starts after the prefill: same first tokens, same KV slots.
        for rid, tok in first.items():
            runner._last[rid] = tok.token_id
        return _decode(runner, reqs, n, 1)

    graphs = runner.graphs
    runner.graphs = None
    run(2)  # warm-up: allocator, cuBLAS handles
    eager_tokens, eager_s = run(steps)
    runner.graphs = graphs
    run(2)  # captures this batch's graph(s)
    graph_tokens, graph_s = run(steps)
    same = sum(a == b for a, b in zip(eager_tokens, graph_tokens, strict=True))
    return {"batch": batch, "eager_ms": eager_s * 1e3, "graph_ms": graph_s * 1e3,
            "speedup": eager_s / graph_s, "same_tokens": f"{same}/{batch}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per mode")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cpu" and env.get("KVRELAY_KERNELS", None) is None:
        env.setenv("KVRELAY_KERNELS", "torch")  # native kernels have no graph path
    from kvrelay.model.loader import load_model

    bs = args.block_size
    per_seq = -(-(args.context + args.steps + 1) // bs)
    blocks = max(args.batch) * per_seq + 1
    m = load_model(args.model, dtype=args.dtype, device=args.device, block_size=bs,
                   num_blocks=blocks, max_model_len=per_seq * bs, enforce_eager=True)
    runner = m.runner
    assert isinstance(runner, ModelRunner)
    capture: Capture = cuda_capture(dev) if dev.type == "cuda" else rerun_capture
    # The last block is the scratch block: no request below is given it.
    enable_decode_graphs(runner, max_num_seqs=max(args.batch), max_len=per_seq * bs,
                         scratch_block=blocks - 1, capture=capture)
    rows = []
    print(f"model {m.name} {args.dtype} on {args.device}, context {args.context}, "
          f"{args.steps} steps")
    print(f"{'batch':>6} {'eager ms':>9} {'graphs ms':>10} {'speedup':>8} {'same tokens':>12}")
    for b in args.batch:
        r = measure(runner, b, args.context, args.steps, blocks - 1, m.config.vocab_size)
        rows.append(r)
        print(f"{b:>6} {r['eager_ms']:>9.2f} {r['graph_ms']:>10.2f} {r['speedup']:>7.2f}x "
              f"{r['same_tokens']:>12}", flush=True)
    assert runner.graphs is not None
    print(f"graphs captured (batch, blocks per sequence): {runner.graphs.captured}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
