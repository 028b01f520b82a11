"""What this CPU can compute natively, read from /proc/cpuinfo: the one place kvrelay
checks CPU features (the native module asks its own build which ISA it runs)."""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_flags() -> set[str]:
    """The kernel's CPU flags (every processor's line alike); empty where unreadable."""
    try:
        return set(CPUINFO.read_text().split())
    except OSError:
        return set()


def cpu_has_native_bf16() -> bool:
    # x86: AVX512-BF16 or AMX; Arm: the bf16 feature (FEAT_BF16).
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})
