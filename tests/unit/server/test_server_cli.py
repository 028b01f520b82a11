"""``kvrelay serve`` as a real process on stand-in model parts: SIGTERM exits 0.

The model is replaced by the unit tests' stand-ins (``build_state`` patched in the
child), so this runs without the model package; the e2e tests do the same on a
real model.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.cli import build_parser
from tests.unit.server.fakes import free_port, stream_in_flight, wait_serving

REPO = Path(__file__).resolve().parents[3]
CHILD = """
import sys
import kvrelay.server.cli as serve_cli
from tests.unit.server.fakes import make_state
serve_cli.build_state = lambda args: make_state(num_blocks=256, max_model_len=256, delay_s=0.02)
from kvrelay.cli import main
sys.exit(main(["serve", "--port", sys.argv[1], "--shutdown-timeout", sys.argv[2],
               "--log-level", "warning"]))
"""


def test_parser_knows_the_commands() -> None:
    args = build_parser().parse_args(
        ["serve", "m.gguf", "--port", "9", "--max-num-seqs", "4", "--served-model-name", "a",
         "b", "--async-scheduling", "--kv-cache-memory", "0.5"]
    )
    assert (args.model, args.port, args.max_num_seqs, args.served_model_name) == (
        "m.gguf", 9, 4, ["a", "b"]
    )
    assert args.async_scheduling and args.kv_cache_memory == 0.5
    assert build_parser().parse_args(["demo"]).func
    bench = build_parser().parse_args(["bench", "serve", "--concurrency", "8"])
    assert bench.concurrency == 8 and bench.num_prompts == 64


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("grace", "sig"),
    [("10", signal.SIGTERM), ("0.2", signal.SIGTERM), ("0.2", signal.SIGINT)],
)
def test_signal_with_a_stream_in_flight_exits_zero(grace: str, sig: signal.Signals) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(port), grace], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(url, proc)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 60, "stream": True}
        lines, t = stream_in_flight(url, body, timeout=30)
        proc.send_signal(sig)
        assert proc.wait(30) == 0
        t.join(10)
        assert lines[-1] == "data: [DONE]"
        # A long grace lets the stream finish; a short one ends it with "abort".
        want = '"finish_reason":"length"' if grace == "10" else '"finish_reason":"abort"'
        assert want in lines[-2]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_names_a_missing_model() -> None:
    from kvrelay.cli import main

    assert main(["serve", "/no/such/model.gguf", "--port", "1"]) == 2
