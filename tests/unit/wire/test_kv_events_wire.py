"""kvrelay's KV-event bytes are vLLM's: checked against a layout written out by hand
(always) and decoded by vLLM 0.32's own structs in vLLM's venv (where it exists)."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import msgspec
import pytest

from kvrelay.core.kv_events import Cleared, Removed, Stored
from kvrelay.wire.kv_events import config_fields, decode_batch, encode_batch, parse_config

REPO = Path(__file__).resolve().parents[3]
H0, H1, H2 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
EVENTS = [Cleared(), Stored((H1, H2), H0, tuple(range(32)), 16), Removed((H1,))]


def test_the_batch_is_vllms_layout_written_out_by_hand() -> None:
    raw = msgspec.msgpack.decode(encode_batch(1733100000.5, EVENTS))
    assert raw == [
        1733100000.5,
        [
            {"type": "AllBlocksCleared"},
            {"type": "BlockStored", "block_hashes": [H1, H2], "parent_block_hash": H0,
             "token_ids": list(range(32)), "block_size": 16, "lora_id": None,
             "medium": "GPU", "lora_name": None, "group_idx": 0},
            {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU", "group_idx": 0},
        ],
        0,  # data_parallel_rank, as vLLM's publisher sets it
    ]
    back = decode_batch(encode_batch(2.0, EVENTS))
    assert [type(e).__name__ for e in back.events] == [
        "AllBlocksCleared", "BlockStored", "BlockRemoved"]


def test_the_config_takes_vllms_fields_and_names_a_wrong_one() -> None:
    assert config_fields() == ["enable_kv_cache_events", "publisher", "endpoint",
                               "replay_endpoint", "buffer_steps", "hwm", "max_queue_size",
                               "topic"]
    cfg = parse_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}')
    assert cfg.enabled and cfg.publisher == "zmq" and cfg.buffer_steps == 10_000
    assert not parse_config('{"endpoint": "tcp://*:0"}').enabled  # off unless enabled
    for bad, named in [('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"),
                       ('{"publisher": "kafka"}', "publisher"),
                       ('{"hwm": 0}', "hwm"), ('{"endpoint": "5557"}', "endpoint"),
                       ('{"topics": ""}', "topics"), ("[1]", "JSON object"),
                       ("{", "not JSON")]:
        with pytest.raises(ValueError, match=named):
            parse_config(bad)


VLLM_VENV = Path(os.environ.get("KVRELAY_VLLM_VENV", "/tmp/anch/v-vllm"))

VLLM_SIDE = textwrap.dedent("""
    import sys
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch)
    from kvrelay.core.kv_events import Cleared, Removed, Stored
    from kvrelay.wire.kv_events import encode_batch

    H0, H1, H2 = b"\\x01" * 32, b"\\x02" * 32, b"\\x03" * 32
    ours = encode_batch(5.25, [Cleared(), Stored((H1, H2), H0, tuple(range(32)), 16),
                               Removed((H1,))])
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(ours)
    cleared, stored, removed = batch.events
    assert isinstance(cleared, AllBlocksCleared)
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == [H1, H2] and stored.parent_block_hash == H0
    assert stored.token_ids == list(range(32)) and stored.block_size == 16
    assert stored.medium == "GPU" and removed.block_hashes == [H1]
    # vLLM's own publisher, building the same events, sends the same bytes.
    theirs = KVEventBatch(ts=5.25, events=[
        AllBlocksCleared(),
        BlockStored(block_hashes=[H1, H2], parent_block_hash=H0, token_ids=list(range(32)),
                    block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0),
        BlockRemoved(block_hashes=[H1], medium="GPU", group_idx=0)], data_parallel_rank=0)
    assert msgspec.msgpack.Encoder().encode(theirs) == ours
    print("vllm decodes kvrelay's batch")
""")


@pytest.mark.skipif(not (VLLM_VENV / "bin" / "python").exists(),
                    reason=f"no vLLM venv at {VLLM_VENV} (KVRELAY_VLLM_VENV)")
def test_vllms_own_structs_decode_kvrelays_bytes_and_encode_the_same() -> None:
    r = subprocess.run([str(VLLM_VENV / "bin" / "python"), "-c", VLLM_SIDE],
                       env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vllm decodes kvrelay's batch" in r.stdout
