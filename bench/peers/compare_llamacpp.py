"""Batch-1 TTFT/TPOT p50 of kvrelay (--quantization gguf and none) and llama.cpp on the
same GGUF, from run_llamacpp.sh's RESULT lines: the median over seeds, and the ratios
to llama.cpp (below 1: kvrelay is faster)."""
import json, os, statistics as st, sys
O = sys.argv[1]
for l in open(f"{O}/machine.txt"): print(l.rstrip())
rows = {}
for tag in ("kv_gguf", "kv_none", "llamacpp"):
    try: res = [json.loads(l.split("RESULT ", 1)[1]) for l in open(f"{O}/{tag}.txt") if "RESULT" in l]
    except OSError: continue
    if res: rows[tag] = {k: st.median(r[k] for r in res) for k in ("ttft_ms_p50", "tpot_ms_p50", "out_tok_s")}
    if res: rows[tag]["seeds"] = ", ".join(f"{r['tpot_ms_p50']:.1f}" for r in res)
ref = rows.get("llamacpp")
print(f"{'engine':<10}{'TTFT p50 ms':>12}{'TPOT p50 ms':>12}{'tok/s':>8}{'TTFT/llama':>11}{'TPOT/llama':>11}  TPOT per seed")
for tag, r in rows.items():
    rt = f"{r['ttft_ms_p50'] / ref['ttft_ms_p50']:>11.2f}{r['tpot_ms_p50'] / ref['tpot_ms_p50']:>11.2f}" if ref else ""
    print(f"{tag:<10}{r['ttft_ms_p50']:>12.1f}{r['tpot_ms_p50']:>12.1f}{r['out_tok_s']:>8.1f}{rt}  {r['seeds']}")
