#!/usr/bin/env bash
# Fetch into .whl/ the wheels that the GPU image (Python 3.12, torch 2.11, no registry)
# lacks for kvrelay's server and relay, at the versions this repo's .venv runs. The
# device tool carries .whl (name it in `carry`); scripts/device-check.sh installs them.
# openai (and its httpx2 chain) is left out: only the demo and the e2e tests need it.
#
#   scripts/device-wheels.sh --nixl   also nixl-cu13 (CUDA 13, as the image) into
#                                     .whl-nixl/: 56 MiB (58,768,877 bytes, 1.5.1 cp312),
#                                     so it and .whl/ do not fit one call's 64 MiB carry;
#                                     carry .whl-nixl alone for the connector's nixl VRAM
#                                     leg (kvrelay.bench.connector_kv needs only torch and
#                                     numpy besides)
set -eu
cd "$(dirname "$0")/.."
PKGS=(msgspec==0.23.0 gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
      pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7
      typing-inspection==0.4.5 opentelemetry-api==1.45.2 llguidance==1.9.1
      typing-extensions==4.16.0)
mkdir -p .whl
PLAT=()
for n in 28 27 17 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLAT[@]}" --platform manylinux2014_x86_64 -d .whl "${PKGS[@]}"
du -sh .whl
if [ "${1:-}" = "--nixl" ]; then
  mkdir -p .whl-nixl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLAT[@]}" --platform manylinux2014_x86_64 -d .whl-nixl \
    nixl-cu13==1.5.1
  du -sh .whl-nixl
fi
