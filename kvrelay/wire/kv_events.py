"""KV events on the wire: vLLM's format and transport, so routers that read vLLM's events
read kvrelay's (``kvrelay serve --kv-events-config JSON``).

The layout is that of vLLM's ``vllm/distributed/kv_events.py`` (0.32), message for
message: a ZMQ PUB socket sends multipart ``(topic, seq, payload)``, ``seq`` an 8-byte
big-endian counter from 0 per publisher life, ``payload`` a msgpack ``KVEventBatch``
(an array ``[ts, events, data_parallel_rank]``) whose events are tagged maps
(``{"type": "BlockStored", ...}``, ``BlockRemoved``, ``AllBlocksCleared``), encoded by
msgspec from structs declared as vLLM declares them (tests/unit/wire/test_kv_events_wire.py
decodes these bytes with vLLM's own structs). With ``replay_endpoint`` a ROUTER socket
answers ``(identity, b"", start_seq)`` with every batch kept from ``start_seq`` on, then
``(b"", -1, b"")``, as vLLM's does.

What a consumer can match on (docs/server.md, "KV events"): ``block_hashes`` are
kvrelay's own (kvrelay.core.prefix_cache: sha256 chain over int64 token ids, salted by
the model's KV compatibility), not vLLM's, so a router that recomputes vLLM's hash from
a prompt finds nothing; ``token_ids`` and ``block_size`` of each BlockStored are what to
key on, and the hashes are the names later BlockRemoved events use.

The engine loop hands each step's events to ``ZmqEventPublisher.offer`` (never blocks:
a full queue drops the batch, counted, and the next batch starts with AllBlocksCleared);
one thread owns the sockets and catches everything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgspec

from kvrelay.core.kv_events import Cleared, KvEvent, Removed, Stored

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's name for an engine's own KV cache (not an offload tier)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# -- vLLM's structs, field for field (names, order, options) -------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def wire_event(e: KvEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if isinstance(e, Stored):
        return BlockStored(block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash,
                           token_ids=list(e.token_ids), block_size=e.block_size, lora_id=None,
                           medium=MEDIUM_GPU, lora_name=None, group_idx=0)
    if isinstance(e, Removed):
        return BlockRemoved(block_hashes=list(e.block_hashes), medium=MEDIUM_GPU, group_idx=0)
    return AllBlocksCleared()


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(ts: float, events: list[KvEvent]) -> bytes:
    """One step's events as vLLM's publisher sends them (rank 0, as vLLM's sets it)."""
    return _encoder.encode(KVEventBatch(ts=ts, events=[wire_event(e) for e in events],
                                        data_parallel_rank=0))


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError / ValidationError on bytes that are not a batch."""
    return _decoder.decode(payload)


# -- the config: vLLM's KVEventsConfig -------------------------------------------------------
@dataclass(frozen=True)
class KvEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null" (as vLLM)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,), "publisher": (str, type(None)), "endpoint": (str,),
    "replay_endpoint": (str, type(None)), "buffer_steps": (int,), "hwm": (int,),
    "max_queue_size": (int,), "topic": (str,),
}


def parse_config(text: str) -> KvEventsConfig:
    """``--kv-events-config``'s JSON, with vLLM's field names; ValueError naming the
    field that is wrong and what is allowed."""
    flag = "--kv-events-config"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{flag}: expected a JSON object of {', '.join(_TYPES)}")
    for key, value in data.items():
        kinds = _TYPES.get(key)
        if kinds is None:
            raise ValueError(f"{flag}: unknown field {key!r}; known: {', '.join(_TYPES)}")
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ValueError(f"{flag}: {key} must be {' or '.join(k.__name__ for k in kinds)}, "
                             f"got {value!r}")
    cfg = KvEventsConfig(**data)
    publisher = cfg.publisher or ("zmq" if cfg.enable_kv_cache_events else "null")
    if publisher not in ("zmq", "null"):
        raise ValueError(f"{flag}: publisher must be \"zmq\" or \"null\", got {publisher!r}")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{flag}: {key} must be >= 1, got {getattr(cfg, key)}")
    for key in ("endpoint", "replay_endpoint"):
        ep = getattr(cfg, key)
        if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{flag}: {key} must be a ZMQ endpoint (tcp://HOST:PORT, "
                             f"ipc://PATH), got {ep!r}")
    return KvEventsConfig(**{**asdict(cfg), "publisher": publisher})


def config_fields() -> list[str]:
    return [f.name for f in fields(KvEventsConfig)]


# -- the publisher ------------------------------------------------------------------------
def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB (and replay ROUTER) sockets owned by one thread, fed by ``offer``."""

    def __init__(self, config: KvEventsConfig) -> None:
        import zmq

        self.config = config
        self._queue: queue.Queue[tuple[float, list[KvEvent]] | None] = queue.Queue(
            maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._reset = False  # a batch was dropped: the next one starts with Cleared
        self.sent = 0
        self.dropped_batches = 0
        self.failures = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: Any = None
        try:
            self.endpoint = self._open(self._pub, config.endpoint)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = _last_endpoint(self._replay)
        except zmq.ZMQError as exc:
            self._close()
            raise ValueError(f"--kv-events-config: cannot open {exc.strerror}: "
                             f"endpoint {config.endpoint!r}, replay_endpoint "
                             f"{config.replay_endpoint!r}") from exc
        self._thread = threading.Thread(target=self._run, name="kvrelay-kv-events",
                                        daemon=True)
        self._thread.start()
        log.info("KV events published on %s%s (topic %r)", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
                 config.topic)

    @staticmethod
    def _open(sock: Any, endpoint: str) -> str:
        if _binds(endpoint):
            sock.bind(endpoint)
            return _last_endpoint(sock)  # port 0: the one the OS chose
        sock.connect(endpoint)
        return endpoint

    def advertised(self) -> dict[str, Any]:
        """What ``GET /v1/kv/events`` tells a consumer. A bound wildcard reads
        ``tcp://0.0.0.0:PORT``: the consumer puts in the host it reaches the engine by."""
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "topic": self.config.topic, "format": "vllm"}

    def offer(self, events: list[KvEvent]) -> None:
        """From the engine loop: never blocks, never raises."""
        if not events:
            return
        try:
            if self._reset:
                events = [Cleared(), *events]
            self._queue.put_nowait((time.time(), events))
            self._reset = False
        except queue.Full:
            self.dropped_batches += 1
            self._reset = True

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for at most ``timeout``), then close the sockets."""
        with contextlib.suppress(queue.Full):  # then the thread, a daemon, dies with us
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        seq = 0
        while True:
            try:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=0.05 if self._replay is not None else 0.5)
                except queue.Empty:
                    continue
                if item is None:
                    return
                payload = encode_batch(*item)
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.sent += 1
            except Exception:  # one batch or one replay fails; the thread goes on
                self.failures += 1
                log.exception("publishing KV events failed")
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("a malformed KV-events replay request (%d frames): ignored",
                        len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _last_endpoint(sock: Any) -> str:
    import zmq

    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
