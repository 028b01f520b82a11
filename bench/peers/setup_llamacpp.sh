#!/bin/bash
# Idempotent: llama.cpp's server (llama-cpp-python[server] 0.3.36, built here from source
# with GGML_NATIVE, 2 build jobs, ~10-20 min on 2 cores) in a virtualenv of its own.
# env: PEERS_ROOT (default /tmp/kvrelay-peers) or LLAMACPP_VENV. Prints LLAMACPP_VENV=.
set -eu
R=${PEERS_ROOT:-/tmp/kvrelay-peers}; mkdir -p $R
V=${LLAMACPP_VENV:-$R/v-llamacpp}
if ! $V/bin/python -c "import llama_cpp.server" 2>/dev/null; then
  python3 -m venv $V
  CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 $V/bin/pip install -q \
    --no-binary llama-cpp-python "llama-cpp-python[server]==0.3.36" >$R/llamacpp-install.log 2>&1
fi
echo "LLAMACPP_VENV=$V"
