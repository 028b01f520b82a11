"""``kvrelay bench grammar``: what structured output costs per token.

On the embedded SmolLM2's 49152-token vocabulary, a JSON document that matches a
schema is fed token by token to a grammar matcher: per token, the mask of allowed
tokens is computed and the token consumed (the work ``GrammarMasks`` does per
constrained request per step). Measured for llguidance (what kvrelay uses) and,
when they are installed, for xgrammar and outlines-core, the alternatives. Then
the sampler on a decode-sized batch (32 rows) with every row constrained against
the same sampler with none: the ratio is the sampling-side slowdown.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
       "address": {"city": "London", "zip": "W1 4AB"}}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("grammar", help="structured output: grammar mask cost per token",
                              description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--batch", type=int, default=32, help="rows in the sampler comparison")
    p.add_argument("--repeat", type=int, default=20, help="timed sampler calls (min is shown)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvrelay.model.formats.gguf_loader import GgufModel
    from kvrelay.model.loader import default_model_path

    tok = GgufModel(default_model_path()).tokenizer
    ids = tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    print(f"vocabulary {tok.vocab_size}, document {len(ids)} tokens")
    print(f"{'library':<15}{'compile ms':>11}{'median us/token':>17}{'max us/token':>14}")
    libs: list[tuple[str, Callable[[Any, list[int]], tuple[float, list[float]]]]] = [
        ("llguidance", _llguidance), ("xgrammar", _xgrammar)]
    for name, fn in libs:
        if importlib.util.find_spec(name) is None:
            print(f"{name:<15}{'not installed':>11}")
            continue
        compile_s, times = fn(tok, ids)
        print(f"{name:<15}{compile_s * 1e3:>11.1f}{statistics.median(times) * 1e6:>17.1f}"
              f"{max(times) * 1e6:>14.1f}")
    _sampler_ratio(tok, ids, args)
    return 0


def _llguidance(tok: Any, ids: list[int]) -> tuple[float, list[float]]:
    import llguidance as llg
    import numpy as np

    lt = llg.LLTokenizer(tok.tok.to_str(), n_vocab=tok.vocab_size,
                         eos_token=list(tok.eos_token_ids))
    t0 = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    m = llg.LLMatcher(lt, grammar)
    compile_s = time.perf_counter() - t0
    words = (tok.vocab_size + 31) // 32
    bits = np.zeros(words, dtype=np.int32)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(bits.ctypes.data, words * 4)
        ok = m.consume_token(t)
        times.append(time.perf_counter() - t0)
        assert ok, m.get_error()
    return compile_s, times


def _xgrammar(tok: Any, ids: list[int]) -> tuple[float, list[float]]:
    import xgrammar as xgr  # imports transformers
    from transformers import PreTrainedTokenizerFast

    info = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tok.tok), vocab_size=tok.vocab_size,
        stop_token_ids=list(tok.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t0 = time.perf_counter()
    m = xgr.GrammarMatcher(compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")))
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bitmask, 0)
        ok = m.accept_token(t)
        times.append(time.perf_counter() - t0)
        assert ok
    return compile_s, times


def _sampler_ratio(tok: Any, ids: list[int], args: argparse.Namespace) -> None:
    """Sampler.sample on (batch, vocab) logits, every row constrained vs none."""
    import torch

    from kvrelay.core.runner import ScheduledRequest
    from kvrelay.model.sampling.grammar import GrammarMasks, GrammarTokenizer
    from kvrelay.model.sampling.sampler import Sampler
    from kvrelay.sampling_params import SamplingParams
    from kvrelay.wire.schema import structured_output

    spec = structured_output("json_schema", json.dumps(SCHEMA))
    sampler = Sampler(0)
    sampler.grammars = GrammarMasks(GrammarTokenizer(tok.tok.to_str, tok.vocab_size,
                                                     tok.eos_token_ids))
    n, half = args.batch, len(ids) // 2
    free = [SamplingParams(temperature=0.0)] * n
    constrained = [SamplingParams(temperature=0.0, structured=spec)] * n
    rids = [f"r{i}" for i in range(n)]
    # Every request halfway through the document (inside a string: a large mask).
    sampler.observe([ScheduledRequest(r, ids[:half], 0, [], True, constrained[0], 0)
                     for r in rids], lambda sr: sr.token_ids)
    logits = torch.randn(n, tok.vocab_size)
    pos = [half] * n

    def best(params: list[SamplingParams]) -> float:
        out = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            sampler.sample(logits.clone(), params, pos, rids)
            out.append(time.perf_counter() - t0)
        return min(out)

    best(free)  # warm-up
    t_free, t_masked = best(free), best(constrained)
    print(f"sampler, {n} rows: unconstrained {t_free * 1e3:.2f} ms, all constrained "
          f"{t_masked * 1e3:.2f} ms ({(t_masked - t_free) / n * 1e6:.0f} us per row)")
    print(f"constrained/unconstrained sampling time ratio: {t_masked / t_free:.2f}")
