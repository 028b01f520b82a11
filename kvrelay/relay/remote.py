"""What the decode side knows of a remote prefill engine: its kv_transfer_params and
the link the receiver sends relay messages over (RelayClient, or the simulator's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvrelay.relay import protocol as P
from kvrelay.relay.transports.base import PeerInfo


@dataclass(frozen=True)
class RemoteKv:
    """``kv_transfer_params`` as the decode engine receives them from the proxy."""

    lease_id: str
    relay: str
    engine_id: str
    block_ids: list[int]
    num_tokens: int
    first_token: int
    compat: str
    # Set by the proxy in front of D (not by P): the client already has the first
    # token's text, so D must not send it again. Without it (vLLM's own proxy, which
    # discards P's answer) D sends the first token itself.
    first_token_sent: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RemoteKv:
        """Parse params; raises ValueError naming the field that is missing or has the
        wrong type (strict: no coercion of strings or floats into ints)."""
        if not isinstance(d, dict):
            raise ValueError(f"expected an object of lease fields, got {type(d).__name__}")
        sent = d.get("first_token_sent", False)
        if not isinstance(sent, bool):
            raise ValueError(f"first_token_sent must be true or false, got {sent!r}")
        return cls(_str(d, "lease_id"), _str(d, "relay"), _str(d, "engine_id"),
                   _int_list(d, "block_ids"), _int(d, "num_tokens"), _int(d, "first_token"),
                   _str(d, "compat"), sent)

    @classmethod
    def from_client(
        cls, d: dict[str, Any], *, vocab_size: int | None = None, block_size: int | None = None
    ) -> RemoteKv:
        """Params from an HTTP request, validated in full before admission: types, the
        relay a host:port we can dial, the first token inside the vocabulary, one block
        per ``block_size`` prompt tokens, no block twice. Raises ValueError naming the
        field and what is allowed."""
        kv = cls.from_dict(d)
        host, sep, port = kv.relay.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"relay must be host:port, got {kv.relay!r}")
        if vocab_size is not None and not 0 <= kv.first_token < vocab_size:
            raise ValueError(f"first_token {kv.first_token} is outside this model's "
                             f"vocabulary [0, {vocab_size})")
        if kv.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {kv.num_tokens}")
        if any(b < 0 for b in kv.block_ids) or len(set(kv.block_ids)) != len(kv.block_ids):
            raise ValueError("block_ids must be distinct non-negative block numbers")
        if block_size is not None:
            need = -(-kv.num_tokens // block_size)
            if len(kv.block_ids) != need:
                raise ValueError(f"block_ids has {len(kv.block_ids)} blocks; {kv.num_tokens} "
                                 f"tokens in blocks of {block_size} need {need}")
        return kv


def _str(d: dict[str, Any], key: str) -> str:
    v = d[key] if key in d else _missing(key)
    if not isinstance(v, str) or not v:
        raise ValueError(f"{key} must be a non-empty string, got {v!r}")
    return v


def _int(d: dict[str, Any], key: str) -> int:
    v = d[key] if key in d else _missing(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} must be an integer, got {v!r}")
    return v


def _int_list(d: dict[str, Any], key: str) -> list[int]:
    v = d[key] if key in d else _missing(key)
    if not isinstance(v, list) or any(isinstance(b, bool) or not isinstance(b, int) for b in v):
        raise ValueError(f"{key} must be a list of integers")
    return list(v)


def _missing(key: str) -> Any:
    raise ValueError(f"the lease field {key!r} is missing")


class RelayLink(Protocol):
    def send(self, relay: str, msg: P.Request) -> None:
        """Fire and forget; a reply (if any) comes back through Receiver.on_reply."""

    def peer(self, relay: str) -> PeerInfo: ...

    def trusted(self, relay: str) -> bool:
        """May KV pulled from ``relay`` be shared with other requests (published in the
        prefix cache)? Only if the relay is known to be a prefill engine of this
        cluster: the params that name it come from the client."""
