"""The prefill side's relay core: engine hand-off into leases, and one answer per message.

Pure (no sockets, no threads): the relay server wraps it with I/O, the simulator
calls it directly, so both run the same logic. The caller serialises calls (the
server holds the engine lock; the simulator is single-threaded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.relay import protocol as P
from kvrelay.relay.lease import Answer, LeaseTable
from kvrelay.relay.port import Request


@dataclass
class KvTransferParams:
    """What the prefill engine hands the proxy for the decode engine (DESIGN section 4)."""

    lease_id: str
    relay: str  # host:port
    engine_id: str
    block_ids: list[int]
    num_tokens: int
    first_token: int
    compat: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class PrefillRelay:
    def __init__(
        self, table: LeaseTable, *, address: str, compat: str, clock: Callable[[], float]
    ) -> None:
        self.table = table
        self.address = address
        self.compat = compat
        self.clock = clock
        # Filled by kv_handoff; taken by whoever answers the client (server, simulator).
        self.kv_params: dict[str, KvTransferParams] = {}

    def kv_handoff(self, req: Request) -> None:
        """The engine's ``kv_handoff``: the finished request's blocks become a lease."""
        lease = self.table.create(
            req.request_id, req.block_ids, self.clock(),
            num_tokens=req.prompt_len, first_token=req.token_ids[-1],
            prompt_digest=P.prompt_digest(req.token_ids[:req.prompt_len]),
        )
        self.kv_params[req.request_id] = KvTransferParams(
            lease.lease_id, self.address, self.table.engine_id, list(lease.block_ids),
            lease.num_tokens, lease.first_token, self.compat,
        )

    def handle(self, msg: P.Request, now: float) -> P.Reply:
        """Exactly one reply per lease message (Read is the transport's, see server)."""
        t = self.table
        if isinstance(msg, P.Acquire):
            ans = t.acquire(msg.engine_id, msg.lease_id, msg.holder, msg.attempt, now,
                            msg.first_block)
        elif isinstance(msg, P.Heartbeat):
            ans = t.heartbeat(msg.engine_id, msg.lease_id, msg.holder, msg.attempt, now)
        elif isinstance(msg, P.Release):
            ans = t.release(msg.engine_id, msg.lease_id, msg.holder, msg.attempt, msg.ok, now)
        elif isinstance(msg, P.Abort):
            # No holder: the proxy's release (in-process only; the relay server
            # requires every message's holder to be its connection's HELLO client id).
            ans = t.abort(msg.engine_id, msg.lease_id, now, msg.holder or None, msg.attempt)
        else:
            return P.Reply(getattr(msg, "seq", 0), "error", code=P.ErrorCode.BAD_FRAME.value,
                           error=f"unexpected {type(msg).__name__.lower()} message")
        return answer_reply(msg.seq, ans)


def answer_reply(seq: int, ans: Answer) -> P.Reply:
    reply = P.Reply(
        seq,
        ans.status.value,
        state=ans.state.value if ans.state else "",
        reason=ans.reason.value if ans.reason else "",
        error=ans.error,
        code=ans.code.value,
    )
    if ans.ok and ans.lease is not None:
        lease = ans.lease
        reply.block_ids = lease.block_ids
        reply.generations = lease.generations
        reply.num_tokens = lease.num_tokens
        reply.first_token = lease.first_token
        reply.prompt_digest = lease.prompt_digest
    return reply
