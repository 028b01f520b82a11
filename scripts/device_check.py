"""Helpers of scripts/device-check.sh (a lent GPU with nothing pre-made).

    python scripts/device_check.py imports                  every kvrelay module imports
    python scripts/device_check.py models DIR [--small] [--device D]
                                                            random-weight checkpoints
    python scripts/device_check.py pd MODEL --device D --out FILE
                                                            1P1D on one device vs colocated

``models`` writes Hugging Face directories through kvrelay's own writer
(kvrelay.testing.models: config, tokenizer, generation config) with random weights of
real shapes: ``smollm2-135m`` and ``llama-1b`` (the benchmark's), and ``smollm2-pd``
(SmolLM2's shape with the test tokenizer's vocabulary, so that generated ids are
text and the 1P1D comparison compares texts). ``--small`` scales every shape down
(the CPU dry run of tests/unit/test_device_check.py).

``pd`` starts a prefill and a decode engine (two processes, ``--kv-transport auto``:
cuda_ipc on one GPU) and a proxy, asks the same greedy requests of the proxy and of the
prefill engine as a colocated engine (requests without kv_transfer_params), and checks
the texts are equal, both pools free afterwards and every lease released ``done``.
Writes a JSON summary to ``--out``; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import pkgutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct's config (docs/model.md, MODEL_NOTES).
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192),
    # A Llama 3.2 1B shape: hidden 2048, 16 layers, 32/8 heads.
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=8192),
}
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def imports() -> int:
    """Import every kvrelay module; print the failures (optional extras excepted)."""
    import kvrelay

    # nixl_peer imports NIXL (kvrelay[nixl]); __main__ would run the CLI; the vLLM
    # connector imports vLLM (kvrelay[vllm]), which a plain kvrelay install lacks
    optional = {"kvrelay.bench.nixl_peer", "kvrelay.__main__"}
    if importlib.util.find_spec("vllm") is None:
        optional |= {"kvrelay.vllm.connector", "kvrelay.vllm.api", "kvrelay.vllm.prom"}
    failed = []
    for mod in pkgutil.walk_packages(kvrelay.__path__, "kvrelay."):
        if mod.name in optional:
            continue
        try:
            importlib.import_module(mod.name)
        except Exception as e:  # report them all, not the first
            failed.append(f"{mod.name}: {type(e).__name__}: {e}")
    import torch

    print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__,
                      "cuda": torch.cuda.is_available(), "import_failures": failed}))
    return 1 if failed else 0


def models(out: Path, small: bool, device: str) -> int:
    import torch
    from safetensors.torch import save_file

    from kvrelay.testing.models import tiny_hf_config, tiny_tokenizer_json, write_hf_dir

    tok = tiny_tokenizer_json()
    tok_vocab = len(json.loads(tok)["model"]["vocab"])
    wanted = {"smollm2-135m": SHAPES["smollm2-135m"], "llama-1b": SHAPES["llama-1b"],
              "smollm2-pd": SHAPES["smollm2-135m"] | {"vocab_size": tok_vocab}}
    g = torch.Generator(device=device).manual_seed(0)
    for name, shape in wanted.items():
        t0 = time.perf_counter()
        cfg = tiny_hf_config("llama", tok_vocab) | shape
        if small:
            cfg |= SMALL | {"vocab_size": min(cfg["vocab_size"], 4096)}
        cfg["torch_dtype"] = "bfloat16"
        d = out / name
        write_hf_dir(d, cfg, {}, tok)  # config, tokenizer, generation config
        save_file({k: v.to("cpu") for k, v in random_weights(cfg, device, g).items()},
                  str(d / "model.safetensors"), metadata={"format": "pt"})
        print(json.dumps({"model": name, "dir": str(d), "seconds": round(
            time.perf_counter() - t0, 1)}), flush=True)
    return 0


def random_weights(cfg: dict[str, Any], device: str, g: Any) -> dict[str, Any]:
    """Llama weights under HF names, bf16, std 0.02 matrices, norms near 1."""
    import torch

    h, inter, v, hd = (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"],
                       cfg["head_dim"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, device=device, generator=g) * 0.02).bfloat16()

    def norm() -> torch.Tensor:
        return (1.0 + torch.randn(h, device=device, generator=g) * 0.1).bfloat16()

    w = {"model.embed_tokens.weight": mat(v, h), "model.norm.weight": norm()}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
              p + "self_attn.q_proj.weight": mat(q, h), p + "self_attn.k_proj.weight": mat(kv, h),
              p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.o_proj.weight": mat(h, q),
              p + "mlp.gate_proj.weight": mat(inter, h), p + "mlp.up_proj.weight": mat(inter, h),
              p + "mlp.down_proj.weight": mat(h, inter)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = mat(v, h)
    return w


PROMPTS = (
    "The quick brown fox",
    "Once upon a time in a land far away there lived",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "hello",
    "A much longer prompt that spans several KV blocks, so that the transfer moves more "
    "than one block and the last block is partial. " * 6,
    "What is the capital of France?",
    "Paris is",
    "naïve café, 日本語 and emoji",
)


def pd(model: Path, device: str, out: Path, transport: str, max_tokens: int,
       logdir: Path) -> int:
    import httpx

    from tests.e2e.cluster import Proc, free_port, metric, metrics, pools_free

    logdir.mkdir(parents=True, exist_ok=True)
    common = ["serve", str(model), "--device", device, "--dtype", "float32",
              "--num-blocks", "512", "--block-size", "16", "--lease-timeout", "10"]
    p = Proc("prefill", [*common, "--role", "prefill", "--relay-port", str(free_port()),
                         "--kv-transport", transport], logdir / "prefill.log")
    d = Proc("decode", [*common, "--role", "decode", "--kv-transport", transport],
             logdir / "decode.log")
    procs = [p, d]
    summary: dict[str, Any] = {"model": str(model), "device": device, "transport": transport}
    try:
        p.start()
        d.start()
        p.wait_healthy(180)
        d.wait_healthy(180)
        x = Proc("proxy", ["proxy", "--prefill", p.url, "--decode", d.url], logdir / "proxy.log")
        procs.append(x)
        x.start().wait_healthy(60)
        mismatches: list[dict[str, Any]] = []
        texts: list[str] = []
        t0 = time.perf_counter()
        with httpx.Client(timeout=120) as c:
            for prompt in PROMPTS:
                body = {"model": model.name, "prompt": prompt, "max_tokens": max_tokens,
                        "temperature": 0.0, "ignore_eos": True}
                want = c.post(p.url + "/v1/completions", json=body).json()
                got = c.post(x.url + "/v1/completions", json=body).json()
                texts.append(want["choices"][0]["text"])
                if texts[-1] != got["choices"][0]["text"]:
                    mismatches.append({"prompt": prompt[:40], "colocated": want, "pd": got})
        summary["seconds"] = round(time.perf_counter() - t0, 2)
        pools_free(d, prefill=(p,), timeout=20)
        pm, dm = metrics(p.url), metrics(d.url)
        summary |= {
            "requests": len(PROMPTS), "mismatches": mismatches, "texts": texts[:2],
            "leases_done": metric(pm, 'kvrelay_leases_released_total{reason="done"}'),
            "leases_not_done": sum(metric(pm, f'kvrelay_leases_released_total{{reason="{r}"}}')
                                   for r in ("failed", "aborted", "expired")),
            "fallbacks": metric(dm, "kvrelay_kv_load_fallbacks_total"),
            "transfer_bytes": metric(dm, "kvrelay_kv_transfer_bytes_total"),
            "fence_failures": metric(dm, "kvrelay_kv_fence_failures_total"),
            "transport_warnings": [ln for ln in d.tail(20000).splitlines()
                                   if "cuda_ipc" in ln and "WARNING" in ln][:3],
        }
        ok = (not mismatches and all(texts) and summary["leases_done"] == len(PROMPTS)
              and not summary["leases_not_done"] and not summary["fallbacks"]
              and summary["transfer_bytes"] > 0)
        summary["ok"] = ok
        return 0 if ok else 1
    except Exception:
        summary["error"] = traceback.format_exc()[-3000:]
        summary["logs"] = {pr.name: pr.tail(3000) for pr in procs}
        summary["ok"] = False
        return 1
    finally:
        for pr in reversed(procs):
            pr.kill()
        out.write_text(json.dumps(summary, indent=1))
        print(json.dumps({k: summary.get(k) for k in
                          ("ok", "requests", "leases_done", "fallbacks", "transfer_bytes",
                           "seconds")}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("imports")
    m = sub.add_parser("models")
    m.add_argument("dir", type=Path)
    m.add_argument("--small", action="store_true")
    m.add_argument("--device", default="cpu")
    q = sub.add_parser("pd")
    q.add_argument("model", type=Path)
    q.add_argument("--device", default="cuda")
    q.add_argument("--transport", default="auto")
    q.add_argument("--max-tokens", type=int, default=32)
    q.add_argument("--out", type=Path, required=True)
    q.add_argument("--logs", type=Path, default=Path("/tmp/kvrelay-pd-logs"))
    a = ap.parse_args()
    if a.cmd == "imports":
        return imports()
    if a.cmd == "models":
        return models(a.dir, a.small, a.device)
    return pd(a.model, a.device, a.out, a.transport, a.max_tokens, a.logs)


if __name__ == "__main__":
    sys.exit(main())
