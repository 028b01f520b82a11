"""A deterministic runner for tests, the simulator and the core benchmark.

The token sampled at sequence position ``pos`` of a request with seed ``seed`` is
``fake_token(seed, pos, vocab_size)``: tests know the exact expected output of any
request, whatever the batching, preemption or pipelining.

With ``check_kv`` the runner keeps a fake KV cache (one tag per token slot) and
verifies, before every sample, that every slot of the request's sequence holds the
KV of exactly the request's tokens up to that position. Like a real model's KV, a
tag depends on the whole token prefix (``KvChains``), not on who wrote it, so a
block shared through the prefix cache verifies, and a block freed and reused
underneath a running request is caught as ``KvCorruption``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.core.block_pool import BlockPool
from kvrelay.core.runner import PLACEHOLDER, Batch, SampledToken, ScheduledRequest

_MASK = (1 << 64) - 1


class KvCorruption(AssertionError):
    pass


def fake_token(seed: int, pos: int, vocab_size: int) -> int:
    """splitmix64 of (seed, pos): a fixed pseudo-random token."""
    z = (seed * 0x9E3779B97F4A7C15 + pos * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) % vocab_size


def expected_output(
    seed: int,
    prompt_len: int,
    max_tokens: int,
    vocab_size: int,
    stop_token_ids: Sequence[int] = (),
) -> list[int]:
    """The tokens a request generates with the fake runner, stop token included."""
    out: list[int] = []
    for i in range(max_tokens):
        tok = fake_token(seed, prompt_len + i, vocab_size)
        out.append(tok)
        if tok in stop_token_ids:
            break
    return out


def chain_tag(prev: int, pos: int, token: int) -> int:
    """The fake KV of ``token`` at ``pos`` after a prefix whose tag is ``prev``."""
    return fake_token(prev ^ (token + 1) * 0x9E3779B1, pos, 1 << 62) + 1


def kv_tags(token_ids: Sequence[int]) -> list[int]:
    """The fake KV tags of a token sequence, position by position."""
    tags: list[int] = []
    for pos, tok in enumerate(token_ids):
        tags.append(chain_tag(tags[-1] if tags else 0, pos, tok))
    return tags


class KvChains:
    """Each request's fake KV tags, position by position (append-only, like its tokens)."""

    def __init__(self) -> None:
        self._tags: dict[str, list[int]] = {}

    def forget(self, request_id: str) -> None:
        self._tags.pop(request_id, None)

    def tags(self, sr: ScheduledRequest, chunk: Sequence[int]) -> list[int]:
        """Tags of positions 0 .. end of ``sr``'s chunk; ``chunk`` is its resolved tokens."""
        tags = self._tags.setdefault(sr.request_id, [])
        known = sr.all_token_ids
        end = sr.start + len(chunk)
        for pos in range(len(tags), end):
            if pos < len(known):
                tok = known[pos]
            elif pos >= sr.start:
                tok = chunk[pos - sr.start]
            else:
                raise KvCorruption(f"{sr.request_id}: token of position {pos} unknown")
            tags.append(chain_tag(tags[-1] if tags else 0, pos, tok))
        return tags


class FakeDeviceWork:
    """A step's completion token (``Batch.completion``) for a device that ends the step's
    work when its driver says so (``finish``): the simulators and tests hold a step's
    blocks with it, as a CUDA event holds them on a GPU."""

    __slots__ = ("finished",)

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def finish(self) -> None:
        self.finished = True

    def wait(self) -> None:
        raise AssertionError("nothing blocks on a fake device: its driver ends the work")


class FakeRunner:
    def __init__(
        self,
        vocab_size: int = 1000,
        *,
        block_size: int = 16,
        pool: BlockPool | None = None,
        check_kv: bool = False,
    ) -> None:
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.pool = pool
        self.check_kv = check_kv
        self._last: dict[str, int] = {}
        self._kv: dict[int, int] = {}  # slot -> tag of the prefix ending there
        self.chains = KvChains()
        self.steps = 0

    def prefix_tags(self, batch: Batch) -> dict[str, list[int]]:
        """Each scheduled request's KV tags up to the end of its chunk. Call before
        ``execute`` (which records this step's samples, changing PLACEHOLDER)."""
        for rid in batch.finished_ids:
            self.chains.forget(rid)
        return {sr.request_id: self.chains.tags(sr, self.resolve(sr)) for sr in batch.requests}

    def execute(self, batch: Batch) -> dict[str, SampledToken]:
        self.steps += 1
        all_tags = self.prefix_tags(batch) if self.check_kv else {}
        for rid in batch.finished_ids:
            self._last.pop(rid, None)
        out: dict[str, SampledToken] = {}
        for sr in batch.requests:
            end = sr.start + len(sr.token_ids)
            if len(sr.block_ids) * self.block_size < end:
                raise KvCorruption(
                    f"{sr.request_id}: {len(sr.block_ids)} blocks cannot hold {end} tokens"
                )
            if self.pool is not None:
                self._check_owned(sr.request_id, sr.block_ids)
            if self.check_kv:
                tags = all_tags[sr.request_id]
                for pos in range(sr.start, end):
                    self._kv[self._slot(sr.block_ids, pos)] = tags[pos]
            if sr.sample:
                if self.check_kv:
                    self._verify(sr.request_id, tags, end, sr.block_ids)
                seed = sr.params.seed if sr.params.seed is not None else 0
                tok = fake_token(seed, end, self.vocab_size)
                self._last[sr.request_id] = tok
                out[sr.request_id] = SampledToken(tok)
        return out

    def _check_owned(self, request_id: str, block_ids: Sequence[int]) -> None:
        owner = f"req:{request_id}"
        pool = self.pool
        for b in block_ids:
            if pool is not None and not pool.holds(b, owner):
                raise KvCorruption(f"{request_id} computes on block {b}, owned by "
                                   f"{pool.owners_of(b) or 'nobody'}")

    def _slot(self, block_ids: Sequence[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def resolve(self, sr: ScheduledRequest) -> list[int]:
        """The chunk's tokens, PLACEHOLDER replaced by the request's previous sample.
        Call before this step's samples are recorded."""
        if PLACEHOLDER not in sr.token_ids:
            return sr.token_ids
        last = self._last.get(sr.request_id)
        if last is None:
            raise KvCorruption(f"{sr.request_id}: placeholder with no previous sample")
        return [last if t == PLACEHOLDER else t for t in sr.token_ids]

    def _verify(self, rid: str, tags: Sequence[int], end: int, block_ids: Sequence[int]) -> None:
        for pos in range(end):
            tag = self._kv.get(self._slot(block_ids, pos))
            if tag != tags[pos]:
                raise KvCorruption(f"{rid}: KV slot of position {pos} holds {tag}, not the "
                                   "KV of the request's tokens")
