"""NIXL READ micro benchmark: two processes on this host, each a NIXL agent (UCX); D READs
a run of blocks from every layer of P's registered cache (vLLM's CPU layout: one
descriptor per layer and run), timed over repeats, one factor varied at a time.

    PYTHONPATH=. .venv/bin/python bench/nixl_micro.py [--repeats 50] [--variants a,b]

Each variant names the agent's progress-thread delay (``pthr``, us; both sides), the UCX
backend's init params (``threads``: NixlConnector's ``num_threads``), how the READ is
made (``create``: createXferReq with fresh descriptor lists, kvrelay's way; ``prep``:
prepXferDlist once, then makeXferReq, NixlConnector's way) and how D waits for it
(``sleep``: check every 1 ms, as kvrelay's receiver; ``spin``: check in a loop);
``mutex``: UCX_USE_MT_MUTEX=y (kvrelay's agent sets it); ``nothread``: D's agent without
a progress thread. ``--cpus 0,1`` pins P to core 0 and D to core 1, as
bench/vllm_connectors.py pins the engines; ``--spinner`` adds a busy Python thread to D,
``--yielder`` a process on D's core looping on sched_yield (vLLM's EngineCore waiting for
its worker). Printed: medians of the READ made and posted, and of made to seen done, in
ms, NIXL's own clock of it (its telemetry: what NixlConnector reports), the fastest and
slowest, how far the spinner got during a post (0: the post kept the GIL), and the CPU
time of D's busiest thread other than the one posting (its progress thread), all repeats.

Found with it (issue 20): on a core shared with D's progress thread, a READ over cma took
twice as long whatever the thread's delay, as UCX's worker spinlock made the woken thread
spin through the copy; with UCX_USE_MT_MUTEX=y it takes as long as without the thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

LAYERS, PIECE, NB, RUN = 30, 3 * 128 * 2 * 64 * 4, 32, 3  # SmolLM2-135M fp32, 128-token blocks


@dataclass(frozen=True)
class Variant:
    pthr: int = 200
    threads: int = 0
    make: str = "create"
    wait: str = "sleep"
    cpus: str = ""  # P's core and D's core ("0,1"), as the vLLM bench pins them; "" = leave
    mutex: bool = False  # UCX_USE_MT_MUTEX=y set in the process before the backend starts
    d_thread: bool = True  # D's agent runs a progress thread (P's always does)
    spinner: bool = False  # a Python thread in D that never sleeps
    yielder: bool = False  # a process on D's core looping on sched_yield (vLLM's EngineCore
    # waiting for its worker's step: shm_broadcast's busy loop)


VARIANTS = {
    "kvrelay": Variant(),
    "pthr0": Variant(pthr=0),
    "threads4": Variant(threads=4),
    "prep": Variant(make="prep"),
    "spin": Variant(wait="spin"),
    "nothread": Variant(d_thread=False),
    "pthr2000": Variant(pthr=2000),
    "mutex": Variant(mutex=True),
    "mutex-pthr0": Variant(pthr=0, mutex=True),
    "nixlconn": Variant(pthr=0, threads=4, make="prep", wait="spin"),
}


def bindings() -> Any:
    from kvrelay.relay.transports.nixl import bindings as b
    return b()


def agent(name: str, v: Variant, telemetry: bool = False) -> Any:
    b = bindings()
    if v.mutex:  # as kvrelay's NixlAgent sets it (transports/nixl.py, UCX_ENV_DEFAULTS)
        os.environ.setdefault("UCX_USE_MT_MUTEX", "y")
    cfg = b.nixlAgentConfig()
    cfg.useProgThread, cfg.useListenThread = v.d_thread or name == "P", False
    cfg.pthrDelay, cfg.syncMode = v.pthr, b.NIXL_THREAD_SYNC_NONE
    if telemetry:
        cfg.captureTelemetry = True
    a = b.nixlAgent(name, cfg)
    a.createBackend("UCX", {"num_threads": str(v.threads)} if v.threads else {})
    return a


def cache() -> np.ndarray:
    buf = np.ones((LAYERS, NB, PIECE), np.uint8)  # touched: no first-touch faults
    return buf


def thread_cpu_ms() -> dict[int, float]:
    """CPU time of each thread of this process, ms (/proc: user + system)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[int(tid)] = 1000 * (int(fields[11]) + int(fields[12])) / tick
    return out


def pin(cpus: str, side: int) -> None:
    if cpus:
        os.sched_setaffinity(0, {int(cpus.split(",")[side])})


def spin(stop: threading.Event, count: list[int]) -> None:
    while not stop.is_set():
        count[0] += 1


def yield_main(cpus: str) -> None:
    pin(cpus, 1)
    while True:
        os.sched_yield()


def p_main(conn: Any, v: Variant) -> None:
    pin(v.cpus, 0)
    b, buf = bindings(), cache()
    a = agent("P", v)
    a.registerMem(b.nixlRegDList(b.DRAM_SEG, [(buf.ctypes.data, buf.nbytes, 0, "")]), [])
    conn.send((bytes(a.getLocalMD()), buf.ctypes.data))
    conn.recv()


def rows(base: int, blocks: list[int]) -> np.ndarray:
    out = np.empty((LAYERS, 3), np.uint64)
    for layer in range(LAYERS):
        out[layer] = (base + (layer * NB + blocks[0]) * PIECE, len(blocks) * PIECE, 0)
    return out


def d_main(conn: Any, v: Variant, repeats: int, out: Any) -> None:
    pin(v.cpus, 1)
    b, buf = bindings(), cache()
    a = agent("D", v, telemetry=True)
    stop, count = threading.Event(), [0]
    if v.spinner:
        threading.Thread(target=spin, args=(stop, count), daemon=True).start()
    a.registerMem(b.nixlRegDList(b.DRAM_SEG, [(buf.ctypes.data, buf.nbytes, 0, "")]), [])
    md, raddr = conn.recv()
    remote = a.loadRemoteMD(md)
    remote = remote.decode() if isinstance(remote, bytes) else remote
    if v.make == "prep":  # every block of every layer, as NixlConnector preps them
        lrows = np.array([(buf.ctypes.data + i * PIECE, PIECE, 0)
                          for i in range(LAYERS * NB)], np.uint64)
        rrows = np.array([(raddr + i * PIECE, PIECE, 0) for i in range(LAYERS * NB)],
                         np.uint64)
        lh = a.prepXferDlist(b.NIXL_INIT_AGENT, b.nixlXferDList(b.DRAM_SEG, lrows), [])
        rh = a.prepXferDlist(remote, b.nixlXferDList(b.DRAM_SEG, rrows), [])
    post, done, tele, spun = [], [], [], []
    cpu0 = thread_cpu_ms()
    for i in range(repeats + 3):
        rb = [(i * RUN) % (NB - RUN) + k for k in range(RUN)]
        lb = [((i + 7) * RUN) % (NB - RUN) + k for k in range(RUN)]
        t0 = time.perf_counter()
        if v.make == "prep":
            li = [layer * NB + blk for layer in range(LAYERS) for blk in lb]
            ri = [layer * NB + blk for layer in range(LAYERS) for blk in rb]
            h = a.makeXferReq(b.NIXL_READ, lh, li, rh, ri, b"", [])
        else:
            ldl = b.nixlXferDList(b.DRAM_SEG, rows(buf.ctypes.data, lb))
            rdl = b.nixlXferDList(b.DRAM_SEG, rows(raddr, rb))
            h = a.createXferReq(b.NIXL_READ, ldl, rdl, remote, b"", [])
        c1 = count[0]
        st = a.postXferReq(h, b"")
        t2, c2 = time.perf_counter(), count[0]
        while st == b.NIXL_IN_PROG:
            if v.wait == "sleep":
                time.sleep(0.001)
            st = a.getXferStatus(h)
        t3 = time.perf_counter()
        assert st == b.NIXL_SUCCESS, st
        t = a.getXferTelemetry(h)
        a.releaseXferReq(h)
        if i >= 3:  # the first READs wire UCX up
            post.append((t2 - t0) * 1e3)
            done.append((t3 - t0) * 1e3)
            tele.append(t.xferDuration / 1e3)
            spun.append(c2 - c1)
    stop.set()
    cpu1 = thread_cpu_ms()
    me = threading.get_native_id()
    others = max((cpu1[t] - cpu0.get(t, 0.0) for t in cpu1 if t != me), default=0.0)
    out.put((statistics.median(post), statistics.median(done), statistics.median(tele),
             min(done), max(done), statistics.median(spun), others))


def run_d(conn: Any, v: Variant, repeats: int, out: Any) -> None:
    try:
        d_main(conn, v, repeats, out)
    finally:
        conn.send(None)


def run(v: Variant, repeats: int) -> tuple[float, ...]:
    ctx = mp.get_context("spawn")
    pc, dc = ctx.Pipe()
    q = ctx.Queue()
    p = ctx.Process(target=p_main, args=(pc, v))
    d = ctx.Process(target=run_d, args=(dc, v, repeats, q))
    y = ctx.Process(target=yield_main, args=(v.cpus,), daemon=True)
    if v.yielder:
        y.start()
    p.start()
    d.start()
    try:
        res: tuple[float, ...] = q.get(timeout=60)
    finally:
        d.join(10)
        for proc in (d, p, y):
            if proc.pid is not None and proc.is_alive():
                proc.kill()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cpus", default="", help="P's core,D's core")
    ap.add_argument("--spinner", action="store_true", help="a busy Python thread in D")
    ap.add_argument("--yielder", action="store_true", help="a sched_yield loop on D's core")
    args = ap.parse_args()
    mb = LAYERS * RUN * PIECE / 2**20
    print(f"{LAYERS} descriptors x {RUN} blocks, {mb:.1f} MiB a READ, {args.repeats} repeats;"
          f" UCX_TLS={os.environ.get('UCX_TLS', '(UCX chooses)')}")
    print(f"{'variant':<10} {'pthr':>5} {'thr':>4} {'make':>7} {'wait':>6} | post ms | "
          "done ms | NIXL ms |  min |  max | spinner | busiest other thread of D, CPU ms")
    for name in args.variants.split(","):
        v = VARIANTS[name]
        v = dataclasses.replace(v, cpus=args.cpus or v.cpus, spinner=args.spinner or v.spinner,
                                yielder=args.yielder or v.yielder)
        post, done, tele, lo, hi, spun, others = run(v, args.repeats)
        print(f"{name:<10} {v.pthr:>5} {v.threads:>4} {v.make:>7} {v.wait:>6} | {post:7.2f} | "
              f"{done:7.2f} | {tele:7.2f} | {lo:4.1f} | {hi:4.1f} | {spun:>7.0f} | {others:.0f}",
              flush=True)


if __name__ == "__main__":
    main()
