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
later on the same host (1P1D on one machine) would find them taken. ``passive`` spins
briefly before it sleeps (``PASSIVE_SPINS``; ``GOMP_SPINCOUNT`` in the environment
wins, 0 sleeps at once): enough to span the gaps inside a step, over before the next.
When ``auto`` finds the cores shared it sleeps at once (spin 0); an ``OMP_WAIT_POLICY``
from the environment gets libgomp's own spin (0 for PASSIVE), kvrelay adds none.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvrelay import env

log = logging.getLogger("kvrelay.model")

WAIT_POLICIES = ("active", "passive", "auto")
# Under PASSIVE a waiting OpenMP thread first spins this many times (libgomp's
# GOMP_SPINCOUNT, one `pause` each: about 0.1 ms on Zen 4), then sleeps. A decode step's
# parallel regions come microseconds apart, and waking a thread that slept costs tens
# of microseconds on a VM, ~150 times a step; the spin ends well before the next step.
PASSIVE_SPINS = 2000
T = TypeVar("T")


@dataclass(frozen=True)
class WaitChoice:
    policy: str  # "ACTIVE" | "PASSIVE"
    requested: str  # "active" | "passive" | "auto" | "env" (OMP_WAIT_POLICY was set)
    reason: str
    spins: int | None = None  # GOMP_SPINCOUNT to set with PASSIVE; None: libgomp's own


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
    if requested == "active":
        return WaitChoice("ACTIVE", requested, "requested")
    if requested == "passive":
        return WaitChoice("PASSIVE", requested, "requested", PASSIVE_SPINS)
    busy = max(other_engines, round(load))
    why = f"{cpus} CPUs in the affinity mask, ~{busy} busy, {threads} threads"
    if cpus - busy >= threads:
        return WaitChoice("ACTIVE", "auto", why + ": a core per thread")
    # Threads that outnumber the free cores: even a short spin holds a core a partner
    # needs (docs/model.md, the spin table's last row).
    return WaitChoice("PASSIVE", "auto", why + ": cores are shared, threads sleep at once", 0)


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


def set_thread_count(threads: int) -> None:
    """Give the calling thread's parallel regions ``threads`` threads.

    OpenMP's thread count is per thread (libgomp's nthreads-var). torch copies its
    process-wide count (``--threads``) into a new thread only lazily, at some of that
    thread's ops; regions opened before that, and by code that asks OpenMP directly (the
    native kernels, oneDNN), take one thread per CPU. The thread that runs the model calls
    this before its first step."""
    import torch

    torch.set_num_threads(threads)


def run_in_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread that ends when it returns, and its OpenMP thread pool with it.

    libgomp keeps a pool of worker threads for every thread that ever opened a parallel
    region. Once the pools together hold more threads than there are CPUs, every waiting
    thread uses libgomp's throttled spin count instead of ``GOMP_SPINCOUNT`` (0 under
    PASSIVE), so each of a decode step's ~150 parallel regions sleeps and wakes its
    threads again: 23 vs 15 ms a batch-8 step on 2 vCPUs (docs/model.md). Loading the
    model on the main thread left such a pool beside the engine thread's; loaded here,
    the engine thread's pool is the only one.
    """
    box: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    # A daemon: Ctrl-C during a long load ends the process instead of waiting for it.
    t = threading.Thread(target=run, name="kvrelay-load", daemon=True)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return box[0]


_wait: WaitChoice | None = None
_spins_ours = False  # GOMP_SPINCOUNT was set by apply_wait_policy, not the environment
_kernels: dict[str, str] = {"backend": "unset", "isa": "", "reason": "", "gemm": "",
                            "prefill_gemm": "", "prompt_attention": ""}


def apply_wait_policy(requested: str | None = None, threads: int | None = None) -> WaitChoice:
    """Sets ``OMP_WAIT_POLICY`` for libgomp; must run before torch is imported (later,
    libgomp has read it already and the call only records what is in force).
    ``requested`` defaults to ``KVRELAY_OMP_WAIT_POLICY``, then ``passive``; threads to
    one per CPU of the affinity mask (torch's default)."""
    global _wait, _spins_ours
    omp = os.environ.get("OMP_WAIT_POLICY")
    if omp and (_wait is None or _wait.requested == "env"):
        _wait = WaitChoice(omp.upper(), "env", "OMP_WAIT_POLICY set in the environment")
        return _wait
    cpus = len(os.sched_getaffinity(0))
    try:
        explicit = requested or env.get("KVRELAY_OMP_WAIT_POLICY", None)
    except ValueError as exc:  # read as kvrelay is imported: a warning, not a failed import
        log.warning("%s; using passive", exc)
        explicit = "passive"
    requested = (explicit or "passive").lower()
    if requested not in WAIT_POLICIES:
        log.warning("OpenMP wait policy %r is not one of %s; using passive",
                    requested, ", ".join(WAIT_POLICIES))
        requested = "passive"
    threads = threads or cpus
    others = _other_engines() if requested == "auto" else 0
    load = os.getloadavg()[0] if requested == "auto" else 0.0
    choice = decide_wait_policy(requested, cpus, threads, others, load)
    # The spin count is ours to set only when the environment did not (an earlier call,
    # the import-time default, may have set it).
    users_spins = "GOMP_SPINCOUNT" in os.environ and not _spins_ours
    spins = os.environ.get("GOMP_SPINCOUNT") if users_spins else (
        None if choice.spins is None else str(choice.spins))
    wanted = (choice.policy, spins)
    in_force = (os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
    if "torch" in sys.modules and wanted != in_force:
        if not explicit:
            return choice  # the import-time default, after an earlier torch import
        log.warning("OpenMP wait policy %s (GOMP_SPINCOUNT %s) asked for after torch was "
                    "imported: %s (GOMP_SPINCOUNT %s) stays", *wanted,
                    in_force[0] or "libgomp's default", in_force[1])
        return _wait or choice
    os.environ["OMP_WAIT_POLICY"] = choice.policy
    if not users_spins:
        os.environ.pop("GOMP_SPINCOUNT", None)
        _spins_ours = spins is not None
        if spins is not None:
            os.environ["GOMP_SPINCOUNT"] = spins
    _wait = choice
    return choice


def record_kernels(backend: str, isa: str, reason: str) -> None:
    _kernels.update(backend=backend, isa=isa, reason=reason)
    wait = _wait.policy if _wait else os.environ.get("OMP_WAIT_POLICY", "")
    spins = os.environ.get("GOMP_SPINCOUNT")
    log.info("kernels: %s (%s); OpenMP wait policy %s%s (%s)", backend, isa or reason,
             wait or "libgomp default", f", GOMP_SPINCOUNT={spins}" if spins else "",
             _wait.reason if _wait else "not chosen by kvrelay")


def record_gemm(gemm: str, why: str, prefill: str = "") -> None:
    """The GEMM of decode-sized steps: ``native-bf16`` (gemms.BF16_GEMM_ROWS rows or
    fewer), ``native-bf16-amx`` (every call: AMX tiles from native.AMX_GEMM_ROWS rows),
    ``native-f32-avx512`` or ``native-f32-avx2`` (gemms.F32_GEMM_ROWS; the ISA the
    kernels run with, ``KVRELAY_NATIVE_ISA=avx2`` forcing AVX2 on an AVX-512 CPU),
    ``native-gguf-*`` (the GGUF codes), ``onednn`` or ``torch``; ``why``: why not the
    native one (``KVRELAY_NATIVE_GEMM=0`` turns it off); ``prefill``: the GEMM of the
    calls above the decode one's rows (the same label where it takes every call)."""
    _kernels.update(gemm=gemm, prefill_gemm=prefill)
    log.info("decode GEMMs: %s%s; prefill GEMMs: %s", gemm, f" ({why})" if why else "",
             prefill or "-")


def record_prompt_attention(route: str) -> None:
    """Where prompt chunks (more than one token) attend: ``native-tiles`` (the default),
    ``amx`` (kvrelay's AMX kernel) or ``sdpa`` (torch's) with KVRELAY_PREFILL_SDPA=1,
    ``native-tiles+sdpa>=N`` (SDPA for the chunks that attend to N positions or more:
    a NativeBackend given such a rule, the tests') or ``torch`` (the torch backend); see
    native.NativeBackend.prompt_route."""
    _kernels.update(prompt_attention=route)
    log.info("prompt attention: %s", route)


def info() -> dict[str, str]:
    """Labels for the /metrics info gauge."""
    wait = _wait.policy if _wait else os.environ.get("OMP_WAIT_POLICY", "")
    return {"backend": _kernels["backend"], "isa": _kernels["isa"], "omp_wait_policy": wait,
            "omp_spincount": os.environ.get("GOMP_SPINCOUNT", ""), "gemm": _kernels["gemm"],
            "prefill_gemm": _kernels["prefill_gemm"],
            "prompt_attention": _kernels["prompt_attention"]}
