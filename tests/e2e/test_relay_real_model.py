"""Two real processes with the tiny random model of kvrelay.model (skipped until the
model package is present): greedy outputs after the hand-over equal a colocated
engine's, through each transport."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.sampling_params import SamplingParams
from tests.e2e.test_relay_two_process import Node, hand_over

pytestmark = pytest.mark.e2e
testing = pytest.importorskip("kvrelay.testing.models")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = testing.write_tiny_hf_model(tmp_path_factory.mktemp("tiny"))
    return path


@pytest.fixture(scope="module")
def prefill(model_dir: Path) -> Iterator[Node]:
    node = Node("prefill", "--model", str(model_dir))
    yield node
    node.close()


def colocated(model_dir: Path, items: list[dict[str, Any]]) -> dict[str, list[int]]:
    from kvrelay.model import load_model

    m = load_model(str(model_dir), num_blocks=256, block_size=4)
    engine = Engine(SchedulerConfig(num_blocks=256, block_size=4,
                                    max_model_len=m.max_model_len), m.runner)
    for it in items:
        engine.add_request(it["rid"], it["prompt"], SamplingParams(
            max_tokens=it["max_tokens"], temperature=0.0, seed=it["seed"], ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_tiny_model_handover_matches_colocated(
    prefill: Node, model_dir: Path, transport: str
) -> None:
    decode = Node("decode", "--transport", transport, "--model", str(model_dir))
    try:
        items = [{"rid": f"{transport}{i}", "prompt": [(11 * i + 3 * j) % 200 + 5
                                                       for j in range(4 + (i * 7) % 50)],
                  "max_tokens": 3 + i % 9, "seed": i} for i in range(50)]
        reply = hand_over(prefill, decode, items)
        want = colocated(model_dir, items)
        for it in items:
            got = [it["kv"]["first_token"], *reply["outputs"][it["rid"]]]
            assert got == want[it["rid"]], it["rid"]
        assert reply["stats"]["loaded"] == 50 and reply["stats"]["fallbacks"] == {}
    finally:
        decode.close()
