"""A prefill or decode engine's leases seen from HTTP: which requests are P/D work
(``kv_transfer_params``, checked), the proxy's ``/v1/kv/release`` (by lease, or by the
release key of a prefill call whose answer it never read), and leases made for a
client that left, given back. The relay itself (kvrelay.relay) keeps the leases."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvrelay.core.engine import LeaseHandle
from kvrelay.relay.release_keys import ReleaseKeys, check_key
from kvrelay.relay.remote import RemoteKv
from kvrelay.server.generation import Generation
from kvrelay.wire.http import ApiError, bad_request, load_json, read_body


class _Settles(Protocol):
    async def settled(self) -> None: ...


class _Model(Protocol):
    @property
    def tokenizer(self) -> Any: ...
    @property
    def block_size(self) -> int | None: ...


class LeaseState(Protocol):
    """What the lease routes read of the server's state (kvrelay.server.api.ServerState)."""

    @property
    def role(self) -> str: ...
    @property
    def release_lease(self) -> Callable[[str, str], dict[str, Any]] | None: ...
    @property
    def release_keys(self) -> ReleaseKeys | None: ...
    @property
    def loop(self) -> _Settles: ...
    @property
    def model(self) -> _Model: ...


class Leases:
    def __init__(self, state: LeaseState, check_auth: Callable[[Request], None]) -> None:
        self.state = state
        self._check_auth = check_auth
        self._releases: set[asyncio.Future[Any]] = set()  # releases by key under way

    async def release(self, request: Request) -> Response:
        """Give back a lease nobody will pull (the proxy, when its client left)."""
        self._check_auth(request)
        if self.state.release_lease is None:
            raise ApiError(404, "this engine holds no leases (it is not --role prefill)")
        body = load_json(await read_body(request))  # a 400 for bad or too deep JSON
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if isinstance(params, dict) and "release_key" in params:
            return JSONResponse(await self._release_by_key(params["release_key"]))
        try:
            if not isinstance(params, dict):
                raise TypeError(f"kv_transfer_params is {type(params).__name__}, not an object")
            engine_id, lease_id = str(params["engine_id"]), str(params["lease_id"])
        except (ValueError, KeyError, TypeError) as exc:
            raise bad_request("kv_transfer_params", f"expected {{'kv_transfer_params': "
                              f"{{'engine_id', 'lease_id'}}}} or {{'kv_transfer_params': "
                              f"{{'release_key'}}}}: {exc}") from exc
        # The lease table is behind the engine lock, held for a whole step: not here.
        answer = await asyncio.to_thread(self.state.release_lease, engine_id, lease_id)
        return JSONResponse(answer)

    async def _release_by_key(self, key: Any) -> dict[str, Any]:
        """The proxy's release of a prefill call whose answer it never read: the lease
        made under ``key`` now, or (not made yet) as soon as it is made."""
        keys, release = self.state.release_keys, self.state.release_lease
        assert keys is not None and release is not None
        try:
            lease = keys.release(check_key(key))
        except ValueError as exc:
            raise bad_request("kv_transfer_params", str(exc)) from exc
        if lease is None:
            return {"status": "pending", "reason": None, "error": None}
        return await asyncio.to_thread(release, lease.engine_id, lease.lease_id)

    def on_lease(self, key: str) -> Callable[[LeaseHandle], None]:
        """The Generation's ``on_lease`` for a prefill call named ``key``."""
        keys, release = self.state.release_keys, self.state.release_lease
        assert keys is not None and release is not None

        def on_lease(lease: LeaseHandle) -> None:
            if not keys.made(key, lease):
                return
            # Released by key before it was made: nobody will read this lease.
            task = asyncio.ensure_future(asyncio.to_thread(
                release, lease.engine_id, lease.lease_id))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

        return on_lease

    async def release_unclaimed(self, gen: Generation) -> None:
        """Prefill role: leases made for a client that left (the proxy cancels its
        request when its own client goes): nobody else will ever pull or release them."""
        release = self.state.release_lease
        if release is None:
            return
        await self.state.loop.settled()  # the aborts applied, every lease output queued
        for lease in gen.drain_leases():
            with contextlib.suppress(Exception):  # a lease already gone: nothing to do
                await asyncio.to_thread(release, lease.engine_id, lease.lease_id)

    def kv_mode(self, body: Any, num_prompts: int) -> tuple[bool, RemoteKv | None]:
        """(remote_decode, remote_kv) from the request's kv_transfer_params."""
        params, role = body.kv_transfer_params, self.state.role
        if not params or not (params.get("do_remote_decode") or params.get("do_remote_prefill")
                              or any(k in params for k in LEASE_FIELDS)):
            return False, None  # e.g. vLLM's {"do_remote_decode": false, ...}: plain work
        if body.n != 1 or num_prompts != 1:
            raise bad_request("kv_transfer_params", "kv_transfer_params takes one prompt, n=1")
        if params.get("do_remote_decode"):
            if role != "prefill":
                raise bad_request("kv_transfer_params", "do_remote_decode needs an engine "
                                  f"started with --role prefill; this one is --role {role}")
            if body.stream:
                raise bad_request("kv_transfer_params", "do_remote_decode takes stream=false")
            if "release_key" in params:
                try:
                    check_key(params["release_key"])
                except ValueError as exc:
                    raise bad_request("kv_transfer_params", str(exc)) from exc
            return True, None
        if role != "decode":
            raise bad_request("kv_transfer_params", "a KV lease can only be pulled by an "
                              f"engine started with --role decode; this one is --role {role}")
        if body.num_prompt_logprobs() is not None:
            # The prompt's positions were computed on the prefill engine, which scores
            # them: the proxy asks it, not the decode engine.
            raise bad_request("prompt_logprobs", "a decode engine pulling a KV lease cannot "
                              "score the prompt (prompt_logprobs, echo with logprobs): its "
                              "prefill engine does")
        _check_lease_fields(params)
        try:
            return False, RemoteKv.from_client(params,
                                               vocab_size=self.state.model.tokenizer.vocab_size,
                                               block_size=self.state.model.block_size)
        except ValueError as exc:
            raise bad_request("kv_transfer_params", f"invalid kv_transfer_params: {exc}") from exc


# The kvrelay lease fields D needs (RemoteKv's required fields); first_token_sent is the
# proxy's optional mark. vLLM's NixlConnector names a prefill engine's blocks with these
# instead, which a kvrelay decode engine cannot pull (no relay, no lease).
LEASE_FIELDS = tuple(f.name for f in dataclasses.fields(RemoteKv)
                     if f.default is dataclasses.MISSING)
NIXL_FIELDS = ("do_remote_prefill", "remote_engine_id", "remote_block_ids", "remote_host",
               "remote_port")


def _check_lease_fields(params: dict[str, Any]) -> None:
    missing = [k for k in LEASE_FIELDS if k not in params]
    if not missing:
        return
    nixl = [k for k in NIXL_FIELDS if k in params]
    hint = (f" These look like vLLM NixlConnector params ({', '.join(nixl)}): a kvrelay "
            "decode engine pulls only the leases of kvrelay prefill engines (kvrelay serve "
            "--role prefill), whose answer carries these fields." if nixl else "")
    raise bad_request("kv_transfer_params", "kv_transfer_params lacks the kvrelay lease "
                      f"field(s) {', '.join(missing)}.{hint}")
