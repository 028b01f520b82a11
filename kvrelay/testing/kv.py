"""Test helpers for the relay: a fake runner that writes a real KV cache tensor.

``TensorFakeRunner`` samples like ``FakeRunner`` (token = fake_token(seed, position))
and also writes, for every computed position, ``kv_value(tag)`` into every element
of that position's slot in a block-major KV tensor, where the tag names the token
prefix ending there (``KvChains``: like a real model's KV, a function of the
tokens, so prefix-cached blocks shared between requests verify). Before sampling it
verifies every earlier position of the request: KV that arrived torn, from the
wrong blocks or not at all raises ``KvCorruption``. So a decode engine that got its
prompt's KV from a prefill engine proves the bytes arrived before its first token.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping

import msgspec
import torch

from kvrelay.core.block_pool import BlockPool
from kvrelay.core.runner import Batch, SampledToken
from kvrelay.relay.geometry import KvGeometry
from kvrelay.relay.transports import nixl
from kvrelay.relay.transports.base import PeerInfo, TransferState
from kvrelay.relay.transports.layout import HostCache, TensorCache
from kvrelay.relay.transports.staging import CHUNK_BYTES, StagedBlocks
from kvrelay.relay.transports.tcp import HostBlocks
from kvrelay.testing.fake_runner import FakeRunner, KvCorruption

TINY_GEOMETRY = KvGeometry(
    architecture="fake", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4,
    dtype="float32",
)


def kv_value(tag: int) -> float:
    return float(tag % 65521 + 1)  # nonzero (a zeroed slot never verifies), exact in float32


def kv_shape(geometry: KvGeometry, num_blocks: int) -> tuple[int, ...]:
    g = geometry
    return (num_blocks, g.num_layers, 2, g.block_size, g.num_kv_heads, g.head_dim)


class TensorFakeRunner:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        *,
        vocab_size: int = 1000,
        pool: BlockPool | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.block_size = int(kv_cache.shape[3])
        self.inner = FakeRunner(vocab_size, block_size=self.block_size, pool=pool)

    def execute(self, batch: Batch) -> Mapping[str, SampledToken]:
        all_tags = self.inner.prefix_tags(batch)
        out = self.inner.execute(batch)  # checks ownership, samples
        for sr in batch.requests:
            tags = all_tags[sr.request_id]
            end = sr.start + len(sr.token_ids)
            self._write(sr.block_ids, tags, sr.start, end)
            if sr.sample:
                self.verify(sr.request_id, sr.block_ids, tags, end)
        return out

    def _write(self, block_ids: list[int], tags: list[int], start: int, end: int) -> None:
        bs = self.block_size
        pos = start
        while pos < end:
            b, s0 = divmod(pos, bs)
            s1 = min(bs, s0 + end - pos)
            vals = torch.tensor([kv_value(tags[p]) for p in range(pos, pos + s1 - s0)],
                                dtype=self.kv_cache.dtype)
            self.kv_cache[block_ids[b], :, :, s0:s1] = vals.view(1, 1, -1, 1, 1)
            pos += s1 - s0

    def verify(self, request_id: str, block_ids: list[int], tags: list[int], end: int) -> None:
        nb = -(-end // self.block_size)
        got = self.kv_cache[block_ids[:nb]]  # (nb, layers, 2, bs, heads, dim)
        got = got.permute(0, 3, 1, 2, 4, 5).reshape(nb * self.block_size, -1)[:end]
        want = torch.tensor([kv_value(tags[p]) for p in range(end)], dtype=got.dtype)
        bad = (got != want.view(-1, 1)).any(dim=1).nonzero()
        if len(bad):
            pos = int(bad[0])
            raise KvCorruption(f"{request_id}: KV of position {pos} is wrong "
                               f"({float(got[pos, 0])} != {float(want[pos])})")


def drive_decode(engine: object, receiver: object, replies: object, now: float) -> list:
    """One iteration of a decode engine's loop: replies in, receiver timers and
    transfers, one engine step. Returns the engine's outputs."""
    import queue

    from kvrelay.core.engine import Engine
    from kvrelay.relay.receiver import Receiver

    assert isinstance(engine, Engine) and isinstance(receiver, Receiver)
    assert isinstance(replies, queue.Queue)
    while True:
        try:
            receiver.on_reply(replies.get_nowait(), now)
        except queue.Empty:
            break
    receiver.tick(now)
    return engine.step()


def move_over_tcp(p: HostCache | TensorCache, d: HostCache | TensorCache, remote: list[int],
                  local: list[int], *, chunk_bytes: int | None = None) -> None:
    """P's blocks ``remote`` into D's ``local`` through the tcp transport's own stream
    code, over a socket pair (layout tests: each side's placement, byte for byte). A
    ``TensorCache`` side (a cache on a GPU, or CPU tensors standing in for one) is
    staged (staging.StagedBlocks, buffers of ``chunk_bytes``), as the connector does."""
    def io(cache: HostCache | TensorCache) -> HostBlocks | StagedBlocks:
        if isinstance(cache, HostCache):
            return HostBlocks(cache)
        return StagedBlocks(cache, chunk_bytes=chunk_bytes or CHUNK_BYTES)

    src, dst = io(p), io(d)
    a, b = socket.socketpair()
    errors: list[BaseException] = []

    def send() -> None:
        try:
            src.send(a, remote)
        except BaseException as e:  # re-raised below
            errors.append(e)

    try:
        sender = threading.Thread(target=send)
        sender.start()
        dst.recv(b, local, threading.Event())
        sender.join()
    finally:
        a.close()
        b.close()
    if errors:
        raise errors[0]


def move_over_nixl(p: HostCache | TensorCache, d: HostCache | TensorCache, remote: list[int],
                   local: list[int], timeout: float = 10.0) -> None:
    """The same through NIXL: P's registration descriptor as the HELLO carries it
    (msgpack), one READ by D, waited for ``timeout`` seconds at most."""
    src, dst = nixl.NixlTransport(), nixl.NixlTransport(d)
    try:
        desc = msgspec.msgpack.decode(msgspec.msgpack.encode(src.register(p)))
        h = dst.read(PeerInfo("p:1", "p", desc), "L", "d", remote, local)
        end = time.monotonic() + timeout
        while (status := dst.poll(h)).state is TransferState.PENDING:
            assert time.monotonic() < end, "the nixl read did not finish"
        assert status.state is TransferState.DONE, status.error
    finally:
        dst.close()
        src.close()
