#!/bin/bash
# A vLLM 0.34.0 venv for driving vLLM's own Scheduler / AsyncScheduler (with kvrelay's
# KV connector) in one process on a machine without a GPU, and no model. Idempotent: a
# second run only checks.
#
# vLLM 0.34 ships no CPU wheel on PyPI, so this is the CUDA wheel, installed --no-deps,
# beside torch 2.14.1 (vLLM pins 2.14.0; this machine's pip caps torch at 2.14.1 and keeps
# that wheel on disk). torch's CUDA build does not import without the CUDA libraries its
# libtorch_cuda.so links (cudart, cublas, cufft, curand, cusparse(+nvjitlink), cufile,
# nvrtc, cudnn, cusparselt, nccl, nvshmem): those wheels are installed --no-deps, from
# the local wheel dir where they lie there (all but nvidia-cuda-runtime). Left out: triton,
# cuda-bindings, cusolver, cupti, nvtx, flashinfer and the rest of vLLM's GPU and server
# requirements, which the scheduler never imports.
#
# No GPU: vLLM 0.34 finds no platform (UnspecifiedPlatform, device_type "") and
# DeviceConfig(device="auto") raises "Failed to infer device type"; pass
# DeviceConfig(device="cpu") (see the check at the end). VLLM_TARGET_DEVICE=cpu is no way
# out: CpuPlatform.check_and_update_config raises "vLLM on x86 CPUs requires Triton
# (triton-cpu)" for this non-CPU wheel.
#
#   KVRELAY_VLLM34_VENV  where the venv goes        (default /tmp/kvrelay-vllm/v-vllm34)
#   KVRELAY_VLLM_MODEL   HF dir for the check       (default <venv>/../smollm2-135m-hf,
#                        made by scripts/vllm-venv.sh; the check is skipped without it)
#   KVRELAY_WHEELS       local dir of the torch and nvidia wheels (default /opt/pypi-more/files;
#                        without it they come from the index)
#   KVRELAY_VLLM34_TRIM  1 (default): delete the CUDA libraries that nothing loads without
#                        a GPU (cuDNN's dlopen'ed sub-libraries, nvrtc's .alt copies, static
#                        archives, nvshmem device bitcode): about 1 GB of 5. 0: keep them
#                        (for a venv that runs on a GPU; remove the venv first)
set -euo pipefail
V=${KVRELAY_VLLM34_VENV:-/tmp/kvrelay-vllm/v-vllm34}
M=${KVRELAY_VLLM_MODEL:-$(dirname "$V")/smollm2-135m-hf}
W=${KVRELAY_WHEELS:-/opt/pypi-more/files}
TRIM=${KVRELAY_VLLM34_TRIM:-1}
HERE=$(cd "$(dirname "$0")/.." && pwd)

TORCH=(torch==2.14.1 nvidia-cublas==13.1.1.3 nvidia-cuda-nvrtc==13.0.88
       nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35
       nvidia-cusparse==12.6.3.3 nvidia-nvjitlink==13.4.92 nvidia-cudnn-cu13==9.24.0.43
       nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7 nvidia-nvshmem-cu13==3.4.5)
CUDART=(nvidia-cuda-runtime==13.0.96)  # not in the local dir: from PyPI
# torch's own pure-Python requirements, and what `import vllm`, the scheduler, vLLM's model
# inspection (a subprocess importing vllm.model_executor.models.llama) and kvrelay's
# connector import, within vLLM 0.34's pins. None of these requires torch.
PYDEPS=(filelock typing-extensions sympy networkx jinja2 fsspec "setuptools>=77.0.3,<81"
        packaging "pydantic>=2.12.0" regex numpy psutil "pyzmq>=25.0.0"
        "transformers>=5.16.1,<5.23.0" "tokenizers>=0.23.3" "huggingface_hub>=2.0.0"
        "safetensors>=0.6.2" "aiohttp>=3.14.4" "requests>=2.33.0" "pillow>=13.0.0"
        pybase64 cachetools cbor2 msgspec cloudpickle uvloop py-cpuinfo
        "prometheus_client>=0.18.0" "llguidance>=1.7.0,<1.8.0" einops
        "apache-tvm-ffi==0.1.11")
NODEPS=(vllm==0.34.0 xgrammar==0.2.8)  # xgrammar requires torch and triton: --no-deps

IMPORTS="import torch, vllm, numpy, msgspec
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
assert vllm.__version__ == '0.34.0', vllm.__version__
assert torch.__version__.startswith('2.14.'), torch.__version__"

pip_quiet() { "$@" 2> >(grep -v "it is neither a file nor a directory" >&2); }

mkdir -p "$(dirname "$V")"
if ! "$V/bin/python" -c "$IMPORTS" >/dev/null 2>&1; then
  [[ -x "$V/bin/python" ]] || python3 -m venv "$V"
  # pip warns about each name the config's file:// indexes lack, and says torch's CUDA
  # requirements are missing (on purpose): neither is an error.
  P=(pip_quiet "$V/bin/pip" install -q --disable-pip-version-check)
  if ls "$W"/torch-2.14.1-*.whl >/dev/null 2>&1; then
    "${P[@]}" --no-deps --no-index --find-links "$W" "${TORCH[@]}"
  else
    "${P[@]}" --no-deps "${TORCH[@]}"
  fi
  "${P[@]}" --no-deps "${CUDART[@]}"
  "${P[@]}" "${PYDEPS[@]}"
  "${P[@]}" --no-deps "${NODEPS[@]}"
  if [[ "$TRIM" == 1 ]]; then
    N=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia
    find "$N/cudnn/lib" -name 'libcudnn_*.so.9' -delete  # libcudnn.so.9 dlopens these
    rm -f "$N"/cu13/lib/libnvrtc.alt.so.13 "$N"/cu13/lib/libnvrtc-builtins.alt.so.13.0 \
          "$N"/nvshmem/lib/libnvshmem_device.bc
    find "$N" -name '*.a' -delete
  fi
  if ! out=$("$V/bin/python" -c "$IMPORTS" 2>&1); then echo "$out" >&2; exit 1; fi
fi
if [[ -f "$M/config.json" ]]; then
  # A VllmConfig and a Scheduler with KvRelayConnector, both roles, on no GPU.
  PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 "$V/bin/python" - "$M" \
      <<'PY' 2>&1 | grep -E "^(OK|Traceback|\w+Error)" || { echo "scheduler check failed" >&2; exit 1; }
import sys, torch
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, VllmConfig)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        KVCacheTensor)
from vllm.v1.structured_output import StructuredOutputManager
for role in ("kv_producer", "kv_consumer"):
    cfg = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(model=sys.argv[1], dtype="float32", max_model_len=1024,
                                 skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=16),
        scheduler_config=SchedulerConfig(max_model_len=1024, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="KvRelayConnector",
                                            kv_connector_module_path="kvrelay.vllm",
                                            kv_role=role))
    cfg.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=64, kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
                       kv_cache_tensors=[KVCacheTensor(size=64 * spec.page_size_bytes,
                                                       layers=["l0"], layer_stride=0,
                                                       block_stride=spec.page_size_bytes)])
    s = Scheduler(cfg, kv, StructuredOutputManager(cfg), block_size=16)
    assert type(s.connector).__name__ == "KvRelayConnector"
print("OK")
PY
fi
echo "KVRELAY_VLLM34_VENV=$V"
