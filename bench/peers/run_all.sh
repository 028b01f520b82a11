#!/bin/bash
# kvrelay against vLLM-CPU, side by side in one run, on the same machine, model, prompts and load:
# offline (32 prompts x 128 token ids, 128 out, greedy, bf16) and served (64 requests x 128 token ids, 64 out,
# concurrency 8, streaming). Run from the project root after `make test` (it uses .venv):
#   make bench-peers   (first run installs vLLM-CPU into $PEERS_ROOT: ~5 min)
# Prints the ratios last; exit 0 when kvrelay is >= 1.3x vLLM on throughput and lower on TTFT and TPOT.
set -u
P=$(cd "$(dirname "$0")" && pwd)
export PEERS_ROOT=${PEERS_ROOT:-/tmp/kvrelay-peers}
eval "$(KVRELAY=$PWD bash $P/setup_vllm.sh | grep =)" || { echo "vLLM setup failed"; exit 1; }
export ANCHOR_OUT=${ANCHOR_OUT:-$PEERS_ROOT/out} VLLM_VENV SMOLLM2_HF KVRELAY=$PWD
rm -rf $ANCHOR_OUT/sbs
bash $P/run_offline.sh
WHICH=${WHICH:-"kv_colo vllm01"} bash $P/run_serve.sh
python3 $P/compare.py $ANCHOR_OUT/sbs
