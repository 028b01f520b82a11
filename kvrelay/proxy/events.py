"""KV-aware routing from the engines' own KV events (``kvrelay proxy --kv-events``).

Instead of guessing an engine's cache from the prompts sent there (proxy_affinity's
``PrefixRecord``), the proxy subscribes to each engine's KV events (vLLM's format,
kvrelay.wire.kv_events) and keeps per engine what its prefix cache holds, in an
``EventRecord``: the same interface (``match``/``insert``/``len``), so the router
(``proxy_affinity.choose``) and whoever asks "how much of this prompt is in that
engine's cache" read it unchanged.

What it matches on is what any router outside the engine can: token ids. A stored
block's key is a chain over its token ids (``token_chain``: blake2b of the parent's key
and the block's int64 tokens), built from each BlockStored's ``parent_block_hash``,
``token_ids`` and ``block_size``; the engine's own hashes only name the blocks for the
BlockRemoved that comes later. A prompt's chain is the same function over its tokens,
which the proxy gets from an engine's ``/tokenize`` (chat through the model's chat
template, as served): one local round trip per prompt, or none for token-id prompts.

Per engine one thread (``Subscriber``) owns a SUB socket: it applies each batch in
sequence order. A gap (a sequence number skipped: the PUB socket's high-water mark,
a reconnect) is filled from the engine's replay socket when it has one, else (or when
the replay lacks some) the engine's record is cleared: what the proxy believes stays a
subset of what the engine holds. A sequence number that goes back (the engine
restarted) clears it too. Each record holds at most ``--routing-cache-size`` blocks
(least recently stored dropped first). The endpoints come from each engine's
``GET /v1/kv/events``, read on every health check round (so engines found by DNS, and
restarted ones, are followed); a wildcard host there is the engine URL's host.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvrelay.proxy.affinity import PrefixRecord
from kvrelay.wire.kv_events import END_SEQ, AllBlocksCleared, BlockStored, decode_batch

log = logging.getLogger(__name__)

EVENTS_PATH = "/v1/kv/events"
ROOT = b"kvrelay-proxy-root"


def token_chain(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT,
                blocks: int | None = None) -> list[bytes]:
    """Keys of the full blocks of ``token_ids`` (at most ``blocks``), chained on ``parent``."""
    n = len(token_ids) // block_size if blocks is None else blocks
    out: list[bytes] = []
    for i in range(n):
        chunk = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(chunk, digest_size=16, key=parent[:64]).digest()
        out.append(parent)
    return out


class EventRecord(PrefixRecord):
    """What one engine's prefix cache holds, from its events; read by the asyncio thread
    (``match``), written by the engine's ``Subscriber`` thread (``apply``)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._lock = threading.Lock()
        self._keys: OrderedDict[bytes, bytes | int] = OrderedDict()  # key -> engine hash
        self._by_hash: dict[bytes | int, bytes] = {}  # engine hash -> key
        self.block_size: int | None = None
        self.orphans = 0  # stored blocks whose parent this record did not know: skipped

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def match(self, chain: Sequence[Any]) -> int:
        with self._lock:
            n = 0
            for key in chain:
                if key not in self._keys:
                    break
                n += 1
            return n

    def insert(self, chain: Sequence[Any]) -> None:
        """Nothing: the engine's events say what it holds, nothing is guessed."""

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()
            self._by_hash.clear()

    def apply(self, events: Sequence[Any]) -> None:
        with self._lock:
            for e in events:
                if isinstance(e, BlockStored):
                    self._stored(e)
                elif isinstance(e, AllBlocksCleared):
                    self._keys.clear()
                    self._by_hash.clear()
                else:  # BlockRemoved
                    for h in e.block_hashes:
                        key = self._by_hash.pop(h, None)
                        if key is not None:
                            self._keys.pop(key, None)

    def _stored(self, e: BlockStored) -> None:
        if e.parent_block_hash is None:
            parent = ROOT
        elif (known := self._by_hash.get(e.parent_block_hash)) is not None:
            parent = known
        else:
            self.orphans += 1
            return
        if len(e.token_ids) != e.block_size * len(e.block_hashes):
            self.orphans += 1
            return
        self.block_size = e.block_size
        for h, key in zip(e.block_hashes,
                          token_chain(e.token_ids, e.block_size, parent), strict=True):
            self._keys[key] = h
            self._keys.move_to_end(key)
            self._by_hash[h] = key
        while len(self._keys) > self.capacity:
            _, h = self._keys.popitem(last=False)
            self._by_hash.pop(h, None)


class Subscriber:
    """One engine's SUB socket and the thread that owns it."""

    def __init__(self, url: str, info: dict[str, Any], record: EventRecord,
                 feed: KvEventsFeed) -> None:
        self.url, self.info, self.record, self.feed = url, info, record, feed
        host = urlsplit(url).hostname or "127.0.0.1"
        self.endpoint = reachable(str(info["endpoint"]), host)
        replay = info.get("replay_endpoint")
        self.replay = reachable(str(replay), host) if replay else None
        self.topic = str(info.get("topic") or "").encode()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvrelay-kv-events-{host}")
        self.last_seq: int | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.connect(self.endpoint)
            while not self._stop.is_set():
                if not sub.poll(200):
                    continue
                try:
                    self._on_message(sub.recv_multipart(), ctx)
                except Exception:  # one bad message: this engine's view restarts
                    log.exception("KV events of %s: a batch failed; its view is cleared",
                                  self.url)
                    self._reset("error")
        except Exception:
            log.exception("KV events of %s: the subscriber stopped", self.url)
        finally:
            sub.close(linger=0)
            ctx.term()

    def _on_message(self, frames: list[bytes], ctx: Any) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            raise ValueError(f"not a KV-events message ({len(frames)} frames)")
        seq = int.from_bytes(frames[1], "big")
        last = self.last_seq
        if last is not None and seq > last + 1:
            self._fill_gap(last + 1, seq, ctx)
        elif last is not None and seq <= last:  # a new publisher life: a new cache
            self._reset("restart")
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        if self._stop.is_set():  # replaced (the engine moved): the record is the new one's
            return
        self.record.apply(decode_batch(payload).events)
        self.last_seq = seq
        self.feed.metrics.batches.labels(self.url).inc()
        self.feed.metrics.blocks.labels(self.url).set(len(self.record))
        if self.record.block_size is not None:
            self.feed.block_size = self.feed.block_size or self.record.block_size

    def _fill_gap(self, first: int, upto: int, ctx: Any) -> None:
        """Batches ``first .. upto - 1`` from the replay socket; cleared if any is
        missing."""
        got = self._replay_range(first, upto, ctx) if self.replay else None
        if got is None or [s for s, _ in got] != list(range(first, upto)):
            self._reset("gap")
            return
        for seq, payload in got:
            self._apply(seq, payload)
        self.feed.metrics.replays.labels(self.url).inc()

    def _replay_range(self, first: int, upto: int, ctx: Any) -> list[tuple[int, bytes]] | None:
        import zmq

        assert self.replay is not None
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.replay)
            sock.send_multipart((b"", first.to_bytes(8, "big")))
            out: list[tuple[int, bytes]] = []
            while sock.poll(2000):  # every wait bounded: a dead replay socket is a gap
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return out
                seq = int.from_bytes(frames[2], "big")
                if first <= seq < upto:
                    out.append((seq, frames[3]))
            return None
        finally:
            sock.close(linger=0)

    def _reset(self, why: str) -> None:
        self.record.clear()
        self.last_seq = None
        self.feed.metrics.resets.labels(self.url, why).inc()
        self.feed.metrics.blocks.labels(self.url).set(0)
        log.info("KV events of %s: view cleared (%s)", self.url, why)


def reachable(endpoint: str, host: str) -> str:
    """``endpoint`` with a wildcard host (``*``, ``0.0.0.0``, ``::``) replaced by the host
    the proxy reaches the engine by."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint
    where, _, port = rest.rpartition(":")
    if where in ("*", "0.0.0.0", "[::]", "::", "[*]"):
        where = f"[{host}]" if ":" in host else host
    return f"tcp://{where}:{port}"


class EventMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Counter("kvrelay_proxy_kv_event_batches",
                               "KV-event batches applied per engine (--kv-events)", ["url"],
                               registry=registry)
        self.resets = Counter("kvrelay_proxy_kv_event_resets",
                              "Times an engine's view was cleared: gap (a sequence number "
                              "missed and not replayed), restart, error", ["url", "reason"],
                              registry=registry)
        self.replays = Counter("kvrelay_proxy_kv_event_replays",
                               "Gaps filled from an engine's replay socket", ["url"],
                               registry=registry)
        self.blocks = Gauge("kvrelay_proxy_kv_event_blocks",
                            "Blocks the proxy knows an engine's prefix cache holds", ["url"],
                            registry=registry)


class _Upstream(Protocol):
    url: str
    healthy: bool
    prefixes: PrefixRecord


Tokenize = Callable[[dict[str, Any]], Awaitable[list[int] | None]]


class KvEventsFeed:
    """The subscribers of every engine, and the token chains of the prompts."""

    def __init__(self, metrics: EventMetrics, chunk_chars: int) -> None:
        self.metrics = metrics
        self.chunk_chars = chunk_chars
        self.block_size: int | None = None  # learned from the first stored blocks
        self._subs: dict[str, Subscriber] = {}
        self._off: set[str] = set()  # engines that said they publish nothing (logged once)

    async def refresh(self, upstreams: Sequence[_Upstream], http: httpx.AsyncClient,
                      headers: dict[str, str]) -> None:
        """Start, restart or stop subscribers to match the engines and what each one
        advertises (called every health check round)."""
        urls = {up.url for up in upstreams}
        for url in [u for u in self._subs if u not in urls]:
            self._subs.pop(url).stop()  # vanished (DNS)
        for up in upstreams:
            if up.healthy and isinstance(up.prefixes, EventRecord):
                await self._follow(up, up.prefixes, http, headers)

    async def _follow(self, up: _Upstream, record: EventRecord, http: httpx.AsyncClient,
                      headers: dict[str, str]) -> None:
        try:
            r = await http.get(f"{up.url}{EVENTS_PATH}", headers=headers, timeout=2.0)
            info = r.json() if r.status_code == 200 else {"off": r.status_code}
        except (httpx.HTTPError, ValueError):
            return  # the health check says what is wrong; try again next round
        old = self._subs.get(up.url)
        if old is not None and old.info == info:
            return
        if old is not None:  # restarted elsewhere, or turned off
            old.stop()
            record.clear()
        if not isinstance(info, dict) or "endpoint" not in info:
            if up.url not in self._off:
                log.warning("engine %s publishes no KV events (%s): routed as one with "
                            "an empty cache", up.url, info)
            self._off.add(up.url)
            self._subs.pop(up.url, None)
            return
        self._off.discard(up.url)
        sub = Subscriber(up.url, info, record, self)
        self._subs[up.url] = sub
        sub.start()
        log.info("KV events of %s: subscribed to %s", up.url, sub.endpoint)

    def close(self) -> None:
        for sub in self._subs.values():
            sub.stop()
        self._subs.clear()

    async def route_keys(self, legs: Sequence[Any], chat: bool, tokenize: Tokenize) -> None:
        """Each leg's chain: the keys of its prompt's full blocks; ``text_len`` its
        length in the router's units (``chunk_chars`` per block), so ``choose``'s
        coverage is matched blocks over prompt blocks. No block size known yet (no
        engine stored anything) or tokenizing failed: no chain (least loaded)."""
        bs = self.block_size
        if bs is None or not legs:
            return
        tokens: list[int] | None = None
        if chat:  # the client's messages and tools, rendered as the engine renders them
            body = legs[0].body
            tokens = await tokenize({k: body[k] for k in ("messages", "tools") if k in body})
        for leg in legs:
            if not chat and leg.counts_prompt:
                prompt = leg.body["prompt"]
                tokens = list(prompt) if isinstance(prompt, list) else await tokenize(
                    {"prompt": prompt, "add_special_tokens": leg.body.get(
                        "add_special_tokens", True)})
            if tokens is None:
                continue
            leg.chain = list(token_chain(tokens, bs))
            leg.text_len = max(1, len(tokens) * self.chunk_chars // bs)


async def tokenize_on(http: httpx.AsyncClient, urls: Sequence[str], headers: dict[str, str],
                      body: dict[str, Any]) -> list[int] | None:
    """The token ids of ``body`` from the first engine that answers ``/tokenize``."""
    for url in urls:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, asyncio.TimeoutError):
            r = await http.post(f"{url}/tokenize", json=body, headers=headers, timeout=5.0)
            if r.status_code == 200:
                return [int(t) for t in r.json()["tokens"]]
            if r.status_code < 500:
                return None  # the engine refuses it: so will the request's own
    return None
