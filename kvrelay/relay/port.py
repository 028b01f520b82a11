"""The narrow port between the relay and an engine (STYLE habit 14).

The relay's lease logic (lease.py, receiver.py) talks to an engine only through
these two small interfaces, never through the engine's or the pool's own methods,
so the same lease logic could serve another engine (for example as a vLLM KV
connector). kvrelay's own engine implements them in ``kvrelay.core.kv_port``; the
server and the simulators wire the two together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvrelay.core.engine import LeaseHandle
from kvrelay.core.lifecycle import Failure, RequestState
from kvrelay.core.request import Request
from kvrelay.core.scheduler import RequestRejected
from kvrelay.sampling_params import SamplingParams

# The engine's names the relay uses (its requests, their states, a refused admission):
# the relay imports them from here and nothing else of the core.
__all__ = ["Failure", "KvLoads", "LeaseBlocks", "LeaseHandle", "Request", "RequestRejected",
           "RequestState"]


class LeaseBlocks(Protocol):
    """Prefill side: the KV blocks a lease holds, in the engine's pool."""

    def hold(self, request_id: str, block_ids: Sequence[int], lease_id: str) -> None:
        """Move a finished request's blocks to the lease, in one step."""

    def release(self, lease_id: str, block_ids: Sequence[int]) -> None:
        """The lease's one release: its blocks return to the pool."""

    def generations(self, block_ids: Sequence[int]) -> list[int]:
        """Each block's current generation (it changes whenever the block is freed)."""

    def held(self, lease_id: str, block_ids: Sequence[int]) -> bool:
        """Does the lease own exactly these blocks now? (integrity checks)"""


class KvLoads(Protocol):
    """Decode side: the engine's requests whose prompt KV comes from a lease.

    A request is admitted with its blocks allocated by the engine (WAITING_FOR_KV);
    the receiver reports the load's outcome exactly once per request.
    """

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
        """Admit the request; True when the first token already finished it (nothing
        to pull). Raises ``RequestRejected`` naming the parameter."""

    def abort(self, request_id: str) -> bool:
        """Abort; False when the request had already finished."""

    def take_waiting(self) -> list[tuple[str, list[int], int]]:
        """(request id, its local block ids, how many of them lead with the prompt's
        KV from the local prefix cache) of requests newly waiting for KV: only the
        blocks after those are pulled."""

    def load_started(self, request_id: str) -> None: ...

    def load_done(self, request_id: str, *, shareable: bool) -> None:
        """The KV is validated (the fence said done): decode from the first token.
        ``shareable``: the KV came from a trusted relay (or nothing was pulled), so the
        request may publish its blocks in the prefix cache."""

    def load_failed(self, request_id: str, error: str, *, recompute: bool,
                    failure: Failure) -> None:
        """No valid KV and the transfer no longer writes: recompute, or fail (with
        ``failure``: the client's params, or a load that failed)."""

    def transfer_ended(self, request_id: str) -> None:
        """An aborted request's transfer stopped writing: its blocks may go."""

    def quarantine(self, request_id: str) -> list[int]:
        """An aborted or failed request's transfer did not stop within its bound: the
        blocks it writes into move to a quarantine owner (never reused while a copy may
        write) and the request ends. Returns the quarantined blocks."""

    def unquarantine(self, request_id: str, block_ids: Sequence[int]) -> None:
        """The late transfer finally stopped: the quarantined blocks return."""
