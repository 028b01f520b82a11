"""`kvrelay bench transfer` runs every path it reports, small: each checks the bytes it
moved (a wrong copy raises), and every row has its reference and ratio."""

from __future__ import annotations

import re

import pytest

from kvrelay.bench import netns
from kvrelay.cli import main
from kvrelay.relay.transports import nixl


@pytest.mark.slow
def test_bench_transfer_small_runs_every_path(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "transfer", "--tokens", "64", "--cache-blocks", "16",
                 "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    want = ["shm transport", "numpy memcpy", "tcp transport", "socket stream"]
    transports = 2
    if nixl.available():
        want += ["nixl transport (UCX chooses)", "NIXL raw READ UCX_TLS=tcp"]
        transports += 2
    if netns.unavailable() is None:
        want += ["tcp transport across netns", "socket stream across netns"]
        transports += 1
        if nixl.available():
            want += ["nixl transport UCX_TLS=tcp across netns",
                     "NIXL raw READ (UCX chooses) across netns"]
            transports += 2
    for row in want:
        assert re.search(rf"^{re.escape(row)}.*\d+\.\d\d", out, flags=re.M), (row, out)
    ratios = out.split("transfer ratios (reference / transport): ")[1].splitlines()[0]
    assert ratios.count(":") == transports
