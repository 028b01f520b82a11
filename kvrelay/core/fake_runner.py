"""A deterministic runner for tests, the simulator and the core benchmark.

The token sampled at sequence position ``pos`` of a request with seed ``seed`` is
``fake_token(seed, pos, vocab_size)``: tests know the exact expected output of any
request, whatever the batching, preemption or pipelining.

With ``check_kv`` the runner keeps a fake KV cache (one tag per token slot) and
verifies, before every sample, that every slot of the request's sequence still
holds what this request wrote there: a block freed and reused underneath a
running request is caught as ``KvCorruption``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.core.block_pool import BlockPool
from kvrelay.core.runner import PLACEHOLDER, Batch, SampledToken

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
        self._kv: dict[int, tuple[str, int, int]] = {}  # slot -> (request, pos, token)
        self.steps = 0

    def execute(self, batch: Batch) -> dict[str, SampledToken]:
        self.steps += 1
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
                self._write(sr.request_id, sr.start, sr.token_ids, sr.block_ids)
            if sr.sample:
                if self.check_kv:
                    self._verify(sr.request_id, end, sr.block_ids)
                seed = sr.params.seed if sr.params.seed is not None else 0
                tok = fake_token(seed, end, self.vocab_size)
                self._last[sr.request_id] = tok
                out[sr.request_id] = SampledToken(tok)
        return out

    def _check_owned(self, request_id: str, block_ids: Sequence[int]) -> None:
        owner = f"req:{request_id}"
        for b in block_ids:
            actual = self.pool.owner_of(b) if self.pool is not None else owner
            if actual != owner:
                raise KvCorruption(f"{request_id} computes on block {b}, owned by {actual}")

    def _slot(self, block_ids: Sequence[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _write(self, rid: str, start: int, tokens: Sequence[int], block_ids: Sequence[int]) -> None:
        for i, tok in enumerate(tokens):
            if tok == PLACEHOLDER:
                if rid not in self._last:
                    raise KvCorruption(f"{rid}: placeholder with no previous sample")
                tok = self._last[rid]
            self._kv[self._slot(block_ids, start + i)] = (rid, start + i, tok)

    def _verify(self, rid: str, end: int, block_ids: Sequence[int]) -> None:
        for pos in range(end):
            tag = self._kv.get(self._slot(block_ids, pos))
            if tag is None or tag[0] != rid or tag[1] != pos:
                raise KvCorruption(f"{rid}: KV slot of position {pos} holds {tag}")
