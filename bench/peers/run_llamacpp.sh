#!/bin/bash
# Batch 1, side by side in one run: kvrelay serve on the embedded Q4_1 GGUF with
# --quantization gguf and with its default, then llama.cpp's server on the same file
# (2 threads each), one request at a time: N (8) prompts of PEER_PROMPT_LEN (128) tokens
# sent as text (llama.cpp's server takes no token ids), OUT_LEN (64) greedy tokens out,
# SEEDS (2) seeds each after a 2-request warm-up. Prints TTFT/TPOT p50 per engine and
# the ratios to llama.cpp (compare_llamacpp.py).
# env: KVRELAY (checkout with .venv; default: this checkout), PEERS_ROOT, LLAMACPP_VENV,
# DTYPE (kvrelay's, default float32), KV_ARGS (extra kvrelay serve flags).
set -u
A=$(cd "$(dirname "$0")" && pwd); KVRELAY=${KVRELAY:-$(cd $A/../.. && pwd)}
export PEERS_ROOT=${PEERS_ROOT:-/tmp/kvrelay-peers}
WHICH=${WHICH:-kv_gguf kv_none llamacpp}
if [[ " $WHICH " == *" llamacpp "* ]]; then
  eval "$(bash $A/setup_llamacpp.sh | grep =)" || { echo "llama.cpp setup failed"; exit 1; }
fi
O=${ANCHOR_OUT:-$PEERS_ROOT/out}/llamacpp; mkdir -p $O; rm -f $O/*.txt
PY=$KVRELAY/.venv/bin/python; K=$KVRELAY/.venv/bin/kvrelay
G=$(PYTHONPATH=$KVRELAY $PY -c "from kvrelay.model.loader import default_model_path as p; print(p())")
# The loadgen's prompts come from the GGUF's own tokenizer (prompts.py), the model name is the file.
export SMOLLM2_HF=$G PYTHONPATH=$KVRELAY DTYPE=${DTYPE:-float32}
LG="$PY $A/b_loadgen.py --text --n ${N:-8} --conc 1 --out-len ${OUT_LEN:-64}"
waitup() { for i in $(seq 600); do curl -sf http://127.0.0.1:$1$2 >/dev/null && return 0; sleep 0.5; done; return 1; }
stop() { kill -INT $1 2>/dev/null; for i in $(seq 60); do kill -0 $1 2>/dev/null || return 0; sleep 0.5; done; kill -KILL $1; }
load() { local port=$1 tag=$2; shift 2; $LG --url http://127.0.0.1:$port --seed 1000 --n 2 "$@" > /dev/null
  for s in $(seq 1 ${SEEDS:-2}); do $LG --url http://127.0.0.1:$port --seed $s "$@" | tee -a $O/$tag.txt | cut -c1-250; done; }
bash $A/machine.sh "batch 1, kvrelay" > $O/machine.txt
for w in $WHICH; do echo "== $w $(date +%T)"
 case $w in
 kv_gguf|kv_none)
  $K serve $G --served-model-name $G --dtype $DTYPE --quantization ${w#kv_} --threads 2 \
    --max-model-len 1024 --max-num-seqs 8 --port 8015 ${KV_ARGS:-} > $O/srv_$w.log 2>&1 & S=$!
  waitup 8015 /health; load 8015 $w; stop $S;;
 llamacpp)
  # n_batch 512: the 128-token prompt in one batch; 2 threads for decode and prefill
  $LLAMACPP_VENV/bin/python -m llama_cpp.server --model $G --model_alias $G --n_threads 2 \
    --n_threads_batch 2 --n_ctx 1024 --n_batch 512 --port 8016 > $O/srv_$w.log 2>&1 & S=$!
  # no ignore_eos in its API: the EOS tokens get a -100 logit bias instead, so every
  # request still runs OUT_LEN tokens
  waitup 8016 /v1/models; load 8016 $w --eos-bias $($PY -c "
from kvrelay.model.formats.gguf_loader import GgufModel; from pathlib import Path
print(','.join(map(str, sorted(GgufModel(Path('$G')).tokenizer.eos_token_ids))))"); stop $S;;
 esac
done; echo "== done $(date +%T)"
python3 $A/compare_llamacpp.py $O
