#!/bin/bash
# One line naming what a run measured on: the part (offline/serve), the dtype, the CPU
# (lscpu model name) and the ISA flags that decide the kernels, and the load average.
# compare.py prints it above the ratios, so every table names its machine and dtype.
f=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|fma|avx512f|avx512_bf16|avx512_vnni|amx_bf16' | tr '\n' ' ')
held=; [[ -n ${PEER_ISA:-} ]] && held=" (both engines held to ${PEER_ISA}: PEER_ISA)"
echo "$1: dtype ${DTYPE:-bfloat16}; CPU $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, flags: ${f% }${held}; load $(cut -d' ' -f1-3 /proc/loadavg)"
