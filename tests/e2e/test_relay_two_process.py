"""Two real processes on localhost: a prefill engine and a decode engine, no HTTP.

50 requests handed over through each transport; the decode side's greedy outputs
equal a colocated engine's token for token (and its runner verified every KV byte
before sampling); kill -9 of the decode process in the middle of a transfer leaves
the prefill pool entirely free once the acquire deadline passes, and the prefill
engine keeps serving.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.kv import TINY_GEOMETRY, TensorFakeRunner, kv_shape

pytestmark = pytest.mark.e2e

NODE = Path(__file__).with_name("relay_node.py")
ROOT = NODE.parents[2]
ACQUIRE_TIMEOUT = 1.5
VOCAB = 1000


class Node:
    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(NODE), *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )
        self.hello = self.read()

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"node exited with {self.proc.poll()}"
        return dict(json.loads(line))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def prefill() -> Iterator[Node]:
    node = Node("prefill", "--acquire-timeout", str(ACQUIRE_TIMEOUT))
    yield node
    node.close()


def colocated(items: list[dict[str, Any]]) -> dict[str, list[int]]:
    kv = torch.zeros(kv_shape(TINY_GEOMETRY, 256))
    engine = Engine(SchedulerConfig(num_blocks=256, block_size=TINY_GEOMETRY.block_size),
                    TensorFakeRunner(kv, vocab_size=VOCAB))
    for it in items:
        engine.add_request(it["rid"], it["prompt"],
                           SamplingParams(max_tokens=it["max_tokens"], seed=it["seed"],
                                          temperature=0.0))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def requests(prefix: str, n: int) -> list[dict[str, Any]]:
    return [
        {"rid": f"{prefix}{i}", "prompt": [(7 * i + j) % VOCAB for j in range(3 + (i * 5) % 40)],
         "max_tokens": 2 + i % 7, "seed": 1000 + i}
        for i in range(n)
    ]


def hand_over(prefill: Node, decode: Node, items: list[dict[str, Any]]) -> dict[str, Any]:
    """In rounds of 10: the prefill pool holds the leases of one round at a time."""
    merged: dict[str, Any] = {"outputs": {}, "stats": {}}
    for i in range(0, len(items), 10):
        chunk = items[i : i + 10]
        for it in chunk:
            it["kv"] = prefill.call({"op": "prefill", **it})
            assert "error" not in it["kv"], it["kv"]
        reply = decode.call({"op": "decode", "items": chunk})
        merged["outputs"].update(reply["outputs"])
        merged["stats"] = reply["stats"]
    return merged


def wait_for(cond: Any, timeout: float, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return dict(got)
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_50_requests_match_colocated(prefill: Node, transport: str) -> None:
    decode = Node("decode", "--transport", transport)
    try:
        items = requests(transport, 50)
        reply = hand_over(prefill, decode, items)
        want = colocated(items)
        for it in items:
            first = it["kv"]["first_token"]
            assert [first, *reply["outputs"][it["rid"]]] == want[it["rid"]], it["rid"]
        assert reply["stats"]["loaded"] == 50 and reply["stats"]["fallbacks"] == {}
        assert reply["stats"]["free"] == 256
        stats = prefill.call({"op": "stats"})
        assert stats["free"] == stats["total"]
    finally:
        decode.close()


def test_kill9_decode_mid_transfer_frees_prefill_after_the_deadline(prefill: Node) -> None:
    stalled = Node("decode", "--transport", "tcp", "--stall")
    items = requests("k", 3)
    for it in items:
        it["kv"] = prefill.call({"op": "prefill", **it})
    stalled.send({"op": "decode", "items": items})
    assert stalled.read() == {"stalled": True}  # bytes are flowing into D's blocks
    wait_for(lambda: (s := prefill.call({"op": "stats"}))["leases"]["pulling"] == 3 and s,
             10.0, "the decode engine to acquire the leases")
    held = prefill.call({"op": "stats"})
    assert held["free"] < held["total"]
    stalled.proc.send_signal(signal.SIGKILL)
    stalled.proc.wait()
    t0 = time.monotonic()
    stats = wait_for(lambda: (s := prefill.call({"op": "stats"}))["free"] == s["total"] and s,
                     ACQUIRE_TIMEOUT + 5.0, "the prefill pool to be free")
    assert time.monotonic() - t0 <= ACQUIRE_TIMEOUT + 1.0
    assert stats["released"].get("expired", 0) >= 3
    # The prefill engine keeps serving.
    decode = Node("decode", "--transport", "shm")
    try:
        more = requests("after", 5)
        reply = hand_over(prefill, decode, more)
        want = colocated(more)
        for it in more:
            assert [it["kv"]["first_token"], *reply["outputs"][it["rid"]]] == want[it["rid"]]
    finally:
        decode.close()
