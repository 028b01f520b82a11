"""``kvrelay bench chaos`` run for real with tiny settings: 1P1D and the proxy as
processes, an abort storm through the proxy. The table has its rows and columns, the
storm really made clients leave at every phase while leases were held, and the ledger
balances: every lease ended and every pool whole within one lease timeout of the last
request (the timing goal is the benchmark's to print, never this test's to assert)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from kvrelay.bench.chaos import Shot, time_to_recover, windows
from tests.e2e.cluster import env


def test_windows_and_the_time_to_recover_come_from_the_token_times() -> None:
    args = argparse.Namespace(before=2.0, storm=2.0, after=4.0, window=1.0)
    # 10 tok/s before, 2 during the storm, then 5, 9 and 12.
    rates = [10, 10, 2, 2, 5, 9, 12, 12]
    shot = Shot("before", 0.0, [k + i / r for k, r in enumerate(rates) for i in range(r)])
    shot.tokens.append(-0.5)  # a warm-up token: in no window
    got = windows([shot], args)
    assert got == [10, 10, 2, 2, 5, 9, 12, 12]
    assert time_to_recover(got, 10.0, args) == 3.0  # 9 is not within 5%: the window of 12
    assert time_to_recover(got, 9.4, args) == 2.0
    assert time_to_recover(got, 13.0, args) is None


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_bench_prints_its_table_and_the_ledger_balances() -> None:
    cmd = [sys.executable, "-m", "kvrelay", "bench", "chaos", "--warmup", "1",
           "--before", "3", "--storm", "4", "--after", "4", "--window", "1",
           "--lease-timeout", "2", "--concurrency", "3", "--abort-fraction", "1",
           "--start-timeout", "120"]
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=280)
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}:\n{out}\n{done.stderr[-3000:]}"
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("phase "))
    assert lines[header].split() == ["phase", "requests", "failed", "tok/s", "vs", "before",
                                     "TTFT", "p50", "ms", "p99", "ms"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 1:header + 4]}
    assert list(rows) == ["before", "storm", "after"]
    for phase, cells in rows.items():
        requests, failed, tok_s, ratio, p50, p99 = (float(c) for c in cells)
        assert requests > 0 and tok_s > 0 and ratio > 0 and 0 < p50 <= p99, (phase, out)
        assert failed == 0 or phase == "storm", out  # steady clients all get their tokens
    assert rows["before"][3] == "1.000"
    left = dict(re.findall(r"(wait_p|pull|decode) (\d+)", _line(lines, "clients that left:")))
    assert all(int(left[k]) > 0 for k in ("wait_p", "pull", "decode")), out
    assert re.fullmatch(r"time to recover: (\d+\.\d s|not within the 4 s after the storm) "
                        r"\(window 1 s; two lease timeouts = 4 s\)",
                        _line(lines, "time to recover:")), out
    held = {line.split()[0]: line.split()[1:] for line in lines
            if re.match(r"[PD] +\d+ of \d+ ", line)}
    assert set(held) == {"P", "D"}, out
    assert float(held["P"][0]) > 0 and float(held["P"][4]) > 0, out  # blocks and leases held
    ledger = _line(lines, "ledger: ")
    assert re.search(r"; 0 still held; pools P whole, D whole \d+\.\d\d s after", ledger), out
    released = re.search(r"released (\d+) \(done (\d+), failed (\d+), aborted (\d+), "
                         r"expired (\d+)\)", ledger)
    assert released is not None, out
    total, *by_outcome = (int(x) for x in released.groups())
    assert total == sum(by_outcome) > 0, out
    # kvrelay_leases_created_total: every lease P made ended exactly once.
    created = re.search(r"\) of (\d+) created; ", ledger)
    assert created is not None and int(created.group(1)) == total, out
    assert _line(lines, "ledger balanced").endswith(": yes"), out
    assert re.fullmatch(r"goal \(.*\): (held|NOT held)", lines[-1]), out


def _line(lines: list[str], start: str) -> str:
    return next(line for line in lines if line.startswith(start))
