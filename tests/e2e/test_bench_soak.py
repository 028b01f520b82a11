"""``kvrelay bench soak`` run for real at a small duration: P, D, the proxy and the
colocated reference as processes, mixed load through the proxy with a fault of each
kind on a schedule. The run's own goal is asserted (exit 0: no wrong text, every failure
one its client saw, every pool whole afterwards), and the report has its parts: the
tally, the faults done, resource samples over time and the first-vs-last summary."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.e2e.cluster import env


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_bench_runs_its_faults_and_every_text_is_right() -> None:
    cmd = [sys.executable, "-m", "kvrelay", "bench", "soak", "--duration-s", "50",
           "--warmup-s", "10", "--fault-every-s", "9", "--sample-every-s", "3",
           "--stop-s", "1", "--partition-s", "2", "--concurrency", "2",
           "--faults", "stop_p", "partition", "restart_proxy", "kill_d", "kill_p",
           "--start-timeout", "180"]
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=580)
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}:\n{out}\n{done.stderr[-3000:]}"
    tally = re.search(r"^requests: (\d+) \((\d+) ok, (\d+) failed, (\d+) wrong, (\d+) left",
                      out, re.M)
    assert tally is not None, out
    total, ok, failed, wrong, left = (int(x) for x in tally.groups())
    assert total == ok + failed + wrong + left and ok > 0 and wrong == 0, out
    faults = re.search(r"^faults \((\d+)\): (.*)$", out, re.M)
    assert faults is not None and int(faults[1]) >= 3, out
    assert faults[2].startswith("stop_p ("), out
    partition = re.search(r"partition \([\d.]+ s\)( skipped: .+?)?(,|$)", faults[2])
    assert partition is not None, out  # done, or skipped with the reason printed
    samples = re.findall(r"^ +\d+ +\d+ +\d+ +\d+ +\d+ .*P tombstones=\d+", out, re.M)
    assert len(samples) >= 3, out
    assert re.search(r"^resources, first vs last sample after the 10 s warm-up", out, re.M)
    for role in ("P", "D", "proxy"):
        assert re.search(rf"^  {role}: rss_mib \d+ -> \d+, fds \d+ -> \d+, threads", out,
                         re.M), out
    assert "pools whole and no lease held after the load: yes" in out, out
    assert out.rstrip().endswith("held"), out
