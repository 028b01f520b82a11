"""The tables and ratios ``kvrelay bench front`` prints (see kvrelay.bench.front)."""

from __future__ import annotations

from kvrelay.bench.front_load import Row

NO_FRONT, PROXY, ROUTER = "none", "kvrelay proxy", "vllm-router"
MODES = ("whole", "stream")


def stub_table(rows: list[Row]) -> str:
    ref = {(r.mode, r.concurrency): r for r in rows if r.front == NO_FRONT}
    out = ["| front | mode | conc | req/s | p50 ms | p99 ms | +p50 ms | +p99 ms | TTFT p50 ms "
           "| TPOT p50 ms | front CPU ms/req | ok |",
           "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        base = ref[(r.mode, r.concurrency)]
        added = ("", "") if r is base else (
            f"{r.ms('latency_s', 'p50') - base.ms('latency_s', 'p50'):+.2f}",
            f"{r.ms('latency_s', 'p99') - base.ms('latency_s', 'p99'):+.2f}")
        stream = r.mode == "stream"
        ttft = f"{r.ms('ttft_s', 'p50'):.2f}" if stream else ""
        tpot = f"{r.ms('tpot_s', 'p50'):.3f}" if stream else ""
        cpu = f"{1e3 * r.cpu_s / len(r.ok):.3f}" if r.cpu_s is not None and r.ok else ""
        out.append(f"| {r.front} | {r.mode} | {r.concurrency} | {r.rate:.0f} "
                   f"| {r.ms('latency_s', 'p50'):.2f} | {r.ms('latency_s', 'p99'):.2f} "
                   f"| {added[0]} | {added[1]} | {ttft} | {tpot} | {cpu} "
                   f"| {len(r.ok)}/{len(r.shots)} |")
    return "\n".join(out)


def _added_p99(rows: list[Row], front: str, mode: str, c: int) -> float | None:
    by = {(r.front, r.mode, r.concurrency): r for r in rows}
    r, base = by.get((front, mode, c)), by.get((NO_FRONT, mode, c))
    if r is None or base is None:
        return None
    return r.ms("latency_s", "p99") - base.ms("latency_s", "p99")


def saturation(rows: list[Row], front: str, mode: str) -> float:
    return max((r.rate for r in rows if r.front == front and r.mode == mode), default=0.0)


def ratios(rows: list[Row]) -> str:
    """The proxy over vllm-router (over no front where the router is absent), per mode:
    the rate at saturation, the added p99 at the lowest concurrency, CPU per request."""
    out = []
    for mode in sorted({r.mode for r in rows}, key=MODES.index):
        c = min(r.concurrency for r in rows)
        sat = {f: saturation(rows, f, mode) for f in (NO_FRONT, PROXY, ROUTER)}
        line = (f"{mode}: saturation req/s: none {sat[NO_FRONT]:.0f}, proxy {sat[PROXY]:.0f}")
        if sat[ROUTER]:
            line += (f", router {sat[ROUTER]:.0f}; proxy/router {sat[PROXY] / sat[ROUTER]:.2f}")
            if sat[ROUTER] > 0.8 * sat[NO_FRONT]:
                line += " (the router is within 20% of no front: the stub and client bound it)"
        proxy, router = _added_p99(rows, PROXY, mode, c), _added_p99(rows, ROUTER, mode, c)
        if proxy is not None:
            line += f"; added p99 at c={c}: proxy {proxy:.2f} ms"
        if router is not None and proxy is not None:
            line += f", router {router:.2f} ms"
            if router > 0:
                line += f", proxy/router {proxy / router:.1f}x"
        cpu_p, cpu_r = _cpu_per_request(rows, PROXY, mode), _cpu_per_request(rows, ROUTER, mode)
        if cpu_p and cpu_r:
            line += f"; CPU/req proxy/router {cpu_p / cpu_r:.1f}x"
        out.append(line)
    return "\n".join(out)


def _cpu_per_request(rows: list[Row], front: str, mode: str) -> float | None:
    mine = [r for r in rows if r.front == front and r.mode == mode and r.cpu_s is not None]
    n = sum(len(r.ok) for r in mine)
    return sum(r.cpu_s or 0.0 for r in mine) / n if n else None


def goals(rows: list[Row], engine_rate: float | None) -> str:
    """Issue 42's two goals, as measured in this run."""
    out = []
    for mode in sorted({r.mode for r in rows}, key=MODES.index):
        c = min(r.concurrency for r in rows)
        proxy, router = _added_p99(rows, PROXY, mode, c), _added_p99(rows, ROUTER, mode, c)
        if proxy is not None and router is not None:
            held = "held" if proxy <= 2 * max(router, 0.0) else "missed"
            out.append(f"goal, {mode}: proxy's added p99 within 2x of the router's at c={c}: "
                       f"{held} ({proxy:.2f} vs {router:.2f} ms)")
        if engine_rate:
            sat = saturation(rows, PROXY, mode)
            held = "held" if sat >= 5 * engine_rate else "missed"
            out.append(f"goal, {mode}: proxy's saturation rate >= 5x the engines' "
                       f"({engine_rate:.2f} req/s): {held} ({sat:.0f} req/s, "
                       f"{sat / engine_rate:.0f}x)")
    return "\n".join(out)


def real_table(rows: list[Row]) -> str:
    ref = {r.concurrency: r for r in rows if r.front == NO_FRONT}
    out = ["| front | conc | req/s | TTFT p50 ms | TTFT p99 ms | +TTFT p50 | +TTFT p99 "
           "| TPOT p50 ms | TPOT p99 ms | +TPOT p50 | front CPU ms/req | ok |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        base = ref[r.concurrency]

        def plus(what: str, q: str, r: Row = r, base: Row = base) -> str:
            return "" if r is base else f"{r.ms(what, q) - base.ms(what, q):+.2f}"

        cpu = f"{1e3 * r.cpu_s / len(r.ok):.3f}" if r.cpu_s is not None and r.ok else ""
        out.append(f"| {r.front} | {r.concurrency} | {r.rate:.2f} "
                   f"| {r.ms('ttft_s', 'p50'):.1f} | {r.ms('ttft_s', 'p99'):.1f} "
                   f"| {plus('ttft_s', 'p50')} | {plus('ttft_s', 'p99')} "
                   f"| {r.ms('tpot_s', 'p50'):.2f} | {r.ms('tpot_s', 'p99'):.2f} "
                   f"| {plus('tpot_s', 'p50')} | {cpu} | {len(r.ok)}/{len(r.shots)} |")
    return "\n".join(out)
