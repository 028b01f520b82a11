"""A client that leaves while its request body is read is a quiet 499, not an
unhandled error answered 500 (found by ``kvrelay bench soak``: the proxy cancelling
its call to D mid-body, 24 'unhandled error' tracebacks on D in 30 minutes)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from kvrelay.wire.http import ApiError, read_body


def test_a_disconnect_mid_body_is_a_499_api_error() -> None:
    messages = [{"type": "http.request", "body": b'{"a": ', "more_body": True},
                {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    with pytest.raises(ApiError) as err:
        asyncio.run(read_body(Request(scope, receive)))
    assert err.value.status == 499 and err.value.code == "client_disconnected"
