"""What the decode side knows of a remote prefill engine: its kv_transfer_params and
the link the receiver sends relay messages over (RelayClient, or the simulator's)."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
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
        """Params from an HTTP request, validated in full before admission: types, a
        length or range bound on every field (nothing a client writes may make a relay
        frame too large or size a resource), the relay a host:port we can dial (made
        canonical: one relay, one key), the first token inside the vocabulary, one block
        per ``block_size`` prompt tokens, no block twice. Raises ValueError naming the
        field and what is allowed."""
        kv = cls.from_dict(d)
        for name in ("lease_id", "engine_id", "compat"):
            _bounded(name, getattr(kv, name), MAX_ID_CHARS)
        _bounded("relay", kv.relay, MAX_RELAY_CHARS)
        relay = canonical_relay(kv.relay)
        vocab = vocab_size if vocab_size is not None else MAX_INT
        if not 0 <= kv.first_token < vocab:
            raise ValueError(f"first_token {kv.first_token} is outside this model's "
                             f"vocabulary [0, {vocab})")
        if not 1 <= kv.num_tokens <= MAX_INT:
            raise ValueError(f"num_tokens must be >= 1 and <= {MAX_INT}, got {kv.num_tokens}")
        # One block holds at least one token: never more blocks than tokens.
        if len(kv.block_ids) > kv.num_tokens:
            raise ValueError(f"block_ids has {len(kv.block_ids)} blocks, more than the "
                             f"{kv.num_tokens} tokens (num_tokens) they hold")
        if any(not 0 <= b <= MAX_INT for b in kv.block_ids) or len(set(kv.block_ids)) != len(
                kv.block_ids):
            raise ValueError(f"block_ids must be distinct non-negative block numbers (at most "
                             f"{MAX_INT})")
        if block_size is not None:
            need = -(-kv.num_tokens // block_size)
            if len(kv.block_ids) != need:
                raise ValueError(f"block_ids has {len(kv.block_ids)} blocks; {kv.num_tokens} "
                                 f"tokens in blocks of {block_size} need {need}")
        return dataclasses.replace(kv, relay=relay) if relay != kv.relay else kv


# Bounds of the params a client writes. P's own values are far inside them (a lease id
# is 32 hex digits, an engine id a host name, a pid and 8 hex digits, compat 16 hex
# digits); they keep every relay frame D builds from them a few hundred bytes.
MAX_ID_CHARS = 300  # lease_id, engine_id, compat
MAX_RELAY_CHARS = 300  # a host name (at most 253) and a port
MAX_INT = 2**31 - 1  # num_tokens, first_token, block numbers
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]{1,253}")


def canonical_relay(relay: str) -> str:
    """``relay`` (host:port) in one spelling per address: the port without leading
    zeros, an IP address in its standard form (no brackets), a host name in lower case
    without a trailing dot. So ``h:05000``, ``h:005000`` and ``H.:5000`` are one relay
    (one connection, one sender, one pool of data sockets). P advertises its relay as
    an IP address in standard form: its proof of the relay secret (bound to the address
    D dials) is unchanged. Raises ValueError for anything but host:port."""
    host, sep, port = relay.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not (sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"relay must be host:port, got {relay[:80]!r}")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        if not _HOST_NAME.fullmatch(host):
            raise ValueError(f"relay must be host:port with an IP address or a host name "
                             f"of letters, digits, '.', '-' and '_'; got {relay[:80]!r}") \
                from None
        host = host.lower().rstrip(".")
        if not host:
            raise ValueError(f"relay must be host:port, got {relay[:80]!r}") from None
    return f"{host}:{int(port)}"


def _bounded(name: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise ValueError(f"{name} has {len(value)} characters; at most {limit} are allowed")


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
