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
        sent = d.get("first_token_sent", False)
        if not isinstance(sent, bool):
            raise TypeError(f"first_token_sent must be true or false, got {sent!r}")
        return cls(str(d["lease_id"]), str(d["relay"]), str(d["engine_id"]),
                   [int(b) for b in d["block_ids"]], int(d["num_tokens"]),
                   int(d["first_token"]), str(d["compat"]), sent)

    @classmethod
    def from_client(cls, d: dict[str, Any]) -> RemoteKv:
        """Params from an HTTP request: the relay must be a host:port we can dial.
        Raises ValueError, KeyError or TypeError naming what is wrong."""
        kv = cls.from_dict(d)
        host, sep, port = kv.relay.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"relay must be host:port, got {kv.relay!r}")
        return kv


class RelayLink(Protocol):
    def send(self, relay: str, msg: P.Request) -> None:
        """Fire and forget; a reply (if any) comes back through Receiver.on_reply."""

    def peer(self, relay: str) -> PeerInfo: ...
