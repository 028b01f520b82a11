"""kvrelay's engine behind the relay's port (kvrelay.relay.port).

``PoolLeaseBlocks`` serves the prefill side's lease table, ``EngineKvLoads`` the
decode side's receiver. They are thin: each method is one engine or pool call, so
the relay never reaches into the engine's or the pool's internals.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvrelay.core.block_pool import BlockPool, lease_owner, request_owner
from kvrelay.core.engine import Engine
from kvrelay.core.lifecycle import Failure, RequestState
from kvrelay.sampling_params import SamplingParams


class PoolLeaseBlocks:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def hold(self, request_id: str, block_ids: Sequence[int], lease_id: str) -> None:
        self.pool.transfer(block_ids, request_owner(request_id), lease_owner(lease_id))

    def release(self, lease_id: str, block_ids: Sequence[int]) -> None:
        self.pool.free(block_ids, lease_owner(lease_id))

    def generations(self, block_ids: Sequence[int]) -> list[int]:
        return self.pool.generations(block_ids)

    def held(self, lease_id: str, block_ids: Sequence[int]) -> bool:
        owner = lease_owner(lease_id)
        return self.pool.owned_count(owner) == len(block_ids) and all(
            self.pool.holds(b, owner) for b in block_ids
        )


class EngineKvLoads:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def admit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        eos_token_ids: Sequence[int],
        remote_kv: Any,
        first_token: int,
    ) -> bool:
        req = self.engine.add_request(
            request_id, prompt_token_ids, params, eos_token_ids=eos_token_ids,
            remote_kv=remote_kv, first_token=first_token,
        )
        return req.state is not RequestState.WAITING

    def abort(self, request_id: str) -> bool:
        return self.engine.abort_request(request_id)

    def take_waiting(self) -> list[tuple[str, list[int], int]]:
        return [(r.request_id, r.block_ids, r.num_cached_blocks)
                for r in self.engine.take_kv_waiting()]

    def load_started(self, request_id: str) -> None:
        self.engine.kv_load_start(request_id)

    def load_done(self, request_id: str, *, shareable: bool) -> None:
        self.engine.kv_load_done(request_id, shareable=shareable)

    def load_failed(self, request_id: str, error: str, *, recompute: bool,
                    failure: Failure) -> None:
        self.engine.kv_load_failed(request_id, error, recompute=recompute, failure=failure)

    def transfer_ended(self, request_id: str) -> None:
        self.engine.kv_transfer_ended(request_id)

    def quarantine(self, request_id: str) -> list[int]:
        return self.engine.kv_quarantine(request_id)

    def unquarantine(self, request_id: str, block_ids: Sequence[int]) -> None:
        self.engine.kv_unquarantine(request_id, block_ids)
