"""``--kv-transport auto`` on the decode side: a same-host transport (shm for a KV cache
in host memory, cuda_ipc for one on a GPU) for a prefill engine on this host, tcp for
one elsewhere, chosen per prefill engine by its relay address."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvrelay.relay import protocol as P
from kvrelay.relay.client import RelayClient, is_local
from kvrelay.relay.transports.base import PeerInfo, TransferStatus, Transport


class AutoLink:
    """A RelayLink that talks to each relay through the client of its transport."""

    def __init__(self, local: RelayClient, remote: RelayClient) -> None:
        self.local, self.remote = local, remote

    def client_for(self, relay: str) -> RelayClient:
        return self.local if is_local(relay) else self.remote

    def send(self, relay: str, msg: P.Request) -> None:
        self.client_for(relay).send(relay, msg)

    def peer(self, relay: str) -> PeerInfo:
        return self.client_for(relay).peer(relay)

    def trusted(self, relay: str) -> bool:
        return self.client_for(relay).trusted(relay)


class AutoTransport:
    name = "auto"

    def __init__(self, local: Transport, remote: Transport) -> None:
        self.local, self.remote = local, remote

    def register(self, kv_cache: Any) -> dict[str, Any]:
        raise NotImplementedError("auto chooses on the decode side; prefill offers both")

    def read(self, peer: PeerInfo, lease_id: str, holder: str, remote_blocks: Sequence[int],
             local_blocks: Sequence[int], *, attempt: str = "") -> tuple[Transport, Any]:
        t = self.local if is_local(peer.relay) else self.remote
        return t, t.read(peer, lease_id, holder, remote_blocks, local_blocks, attempt=attempt)

    def name_of(self, handle: tuple[Transport, Any]) -> str:
        """The transport that carries ``handle`` (for the per-transport metrics)."""
        t, h = handle
        name_of = getattr(t, "name_of", None)
        return str(name_of(h)) if name_of is not None else str(getattr(t, "name", "unknown"))

    def poll(self, handle: tuple[Transport, Any]) -> TransferStatus:
        return handle[0].poll(handle[1])

    def cancel(self, handle: tuple[Transport, Any]) -> None:
        handle[0].cancel(handle[1])
