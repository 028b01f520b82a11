#!/bin/bash
# Idempotent: llama.cpp's server (llama-cpp-python[server] 0.3.36, built here from source
# for this CPU's instruction sets, 2 build jobs, ~10-20 min on 2 cores) in a virtualenv of
# its own. Not GGML_NATIVE: on the Intel Xeon VM with AMX (2026-12-02) its -march=native
# build died of SIGILL at the first completion; the AVX-512 (VNNI, BF16) or AVX2 paths
# are named from /proc/cpuinfo instead (and no wheel cache: it ignores CMAKE_ARGS).
# env: PEERS_ROOT (default /tmp/kvrelay-peers) or LLAMACPP_VENV. Prints LLAMACPP_VENV=.
set -eu
R=${PEERS_ROOT:-/tmp/kvrelay-peers}; mkdir -p $R
V=${LLAMACPP_VENV:-$R/v-llamacpp}
if ! $V/bin/python -c "import llama_cpp.server" 2>/dev/null; then
  python3 -m venv $V
  F=$(grep -m1 '^flags' /proc/cpuinfo)
  has() { [[ " $F " == *" $1 "* ]] && echo ON || echo OFF; }
  ISA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)"
  ISA="$ISA -DGGML_F16C=$(has f16c) -DGGML_AVX512=$(has avx512f)"
  ISA="$ISA -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
  CMAKE_ARGS="$ISA" CMAKE_BUILD_PARALLEL_LEVEL=2 $V/bin/pip install -q --no-cache-dir \
    --no-binary llama-cpp-python "llama-cpp-python[server]==0.3.36" >$R/llamacpp-install.log 2>&1
fi
echo "LLAMACPP_VENV=$V"
