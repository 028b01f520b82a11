"""Which kernels and which OpenMP wait policy this process runs with.

Pure Python, no torch: ``kvrelay/__init__.py`` resolves the wait policy here before
torch is imported (libgomp reads ``OMP_WAIT_POLICY`` once, when it loads), and the
server's /metrics reads the record without touching the model.

Wait policy (``kvrelay --omp-wait-policy`` or ``KVRELAY_OMP_WAIT_POLICY`` = ``active`` |
``passive`` | ``auto``, default ``passive``; an explicit ``OMP_WAIT_POLICY`` in the
environment wins over both):
spinning threads answer a parallel region sooner (ACTIVE, about 25-35% faster decode
steps on dedicated cores) but lose badly when another process holds a core they spin
on (4-20x slower steps, docs/model.md). ``auto`` picks ACTIVE only when this process
has a core of its own for every OpenMP thread: the CPUs in its affinity mask, less
the other kvrelay engines' threads on the host, less the current run queue (1-minute
load average, rounded), cover the threads it will start. The default stays
``passive``: an ACTIVE engine spins on its cores even when idle, so engines started
later on the same host (1P1D on one machine) would find them taken.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

log = logging.getLogger("kvrelay.model")

WAIT_POLICIES = ("active", "passive", "auto")


@dataclass(frozen=True)
class WaitChoice:
    policy: str  # "ACTIVE" | "PASSIVE"
    requested: str  # "active" | "passive" | "auto" | "env" (OMP_WAIT_POLICY was set)
    reason: str


def decide_wait_policy(
    requested: str, cpus: int, threads: int, other_engines: int, load: float
) -> WaitChoice:
    """``cpus``: CPUs this process may run on; ``threads``: OpenMP threads it will use;
    ``other_engines``: other kvrelay engine processes on the host (each assumed to keep
    a core busy); ``load``: the 1-minute load average, which counts those engines too."""
    if requested not in WAIT_POLICIES:
        raise ValueError(
            f"OpenMP wait policy {requested!r} is not one of {', '.join(WAIT_POLICIES)}"
        )
    if requested != "auto":
        return WaitChoice(requested.upper(), requested, "requested")
    busy = max(other_engines, round(load))
    why = f"{cpus} CPUs in the affinity mask, ~{busy} busy, {threads} threads"
    if cpus - busy >= threads:
        return WaitChoice("ACTIVE", "auto", why + ": a core per thread")
    return WaitChoice("PASSIVE", "auto", why + ": cores are shared, threads sleep")


def _other_engines() -> int:
    """kvrelay engine processes (``kvrelay serve``) on the host other than this one:
    read once at start from /proc, never on a hot path."""
    me, n = os.getpid(), 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
    except OSError:
        return 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and any(a.endswith(b"kvrelay") for a in argv[:3]):
            n += 1
    return n


_wait: WaitChoice | None = None
_kernels: dict[str, str] = {"backend": "unset", "isa": "", "reason": "", "gemm": ""}


def apply_wait_policy(requested: str | None = None, threads: int | None = None) -> WaitChoice:
    """Sets ``OMP_WAIT_POLICY`` for libgomp; must run before torch is imported (later,
    libgomp has read it already and the call only records what is in force).
    ``requested`` defaults to ``KVRELAY_OMP_WAIT_POLICY``, then ``passive``; threads to
    one per CPU of the affinity mask (torch's default)."""
    global _wait
    env = os.environ.get("OMP_WAIT_POLICY")
    if env and (_wait is None or _wait.requested == "env"):
        _wait = WaitChoice(env.upper(), "env", "OMP_WAIT_POLICY set in the environment")
        return _wait
    cpus = len(os.sched_getaffinity(0))
    explicit = requested or os.environ.get("KVRELAY_OMP_WAIT_POLICY")
    requested = (explicit or "passive").lower()
    if requested not in WAIT_POLICIES:
        log.warning("KVRELAY_OMP_WAIT_POLICY=%r is not one of %s; using passive",
                    requested, ", ".join(WAIT_POLICIES))
        requested = "passive"
    threads = threads or cpus
    others = _other_engines() if requested == "auto" else 0
    load = os.getloadavg()[0] if requested == "auto" else 0.0
    choice = decide_wait_policy(requested, cpus, threads, others, load)
    if "torch" in sys.modules and choice.policy != os.environ.get("OMP_WAIT_POLICY"):
        if not explicit:
            return choice  # the import-time default, after an earlier torch import
        log.warning("OpenMP wait policy %s asked for after torch was imported: %s stays",
                    choice.policy, os.environ.get("OMP_WAIT_POLICY", "libgomp's default"))
        return _wait or choice
    os.environ["OMP_WAIT_POLICY"] = choice.policy
    _wait = choice
    return choice


def record_kernels(backend: str, isa: str, reason: str) -> None:
    _kernels.update(backend=backend, isa=isa, reason=reason)
    wait = _wait.policy if _wait else os.environ.get("OMP_WAIT_POLICY", "")
    log.info("kernels: %s (%s); OpenMP wait policy %s (%s)", backend, isa or reason,
             wait or "libgomp default", _wait.reason if _wait else "not chosen by kvrelay")


def record_gemm(gemm: str, why: str) -> None:
    """The GEMM of decode-sized steps: ``native-bf16`` (model.SMALL_GEMM_ROWS rows or
    fewer), ``onednn`` or ``torch``; ``why``: why not the native one."""
    _kernels.update(gemm=gemm)
    log.info("decode GEMMs: %s%s", gemm, f" ({why})" if why else "")


def info() -> dict[str, str]:
    """Labels for the /metrics info gauge."""
    wait = _wait.policy if _wait else os.environ.get("OMP_WAIT_POLICY", "")
    return {"backend": _kernels["backend"], "isa": _kernels["isa"], "omp_wait_policy": wait,
            "gemm": _kernels["gemm"]}
