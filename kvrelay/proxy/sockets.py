"""httpcore's own network backend (anyio), each connection's socket looked up once.

Before it assigns a request to a connection, httpcore's pool asks every idle pooled
connection whether its engine closed it (``has_expired``: is the socket readable?), and
anyio answers each ask by building a dict of every attribute of the stream to read one:
~4% of the proxy's CPU per request at 8 requests in flight (kvrelay bench front). Here
the raw socket is read once, when the connection is made; the check asked of it is
httpcore's own (``is_socket_readable``). Connecting, reading, writing, closing, TLS,
timeouts and the errors raised are the anyio backend's, untouched.

It leans on httpcore's private modules (1.0): where they are not there, ``backend()``
is None and the pool keeps its own backend (the same answers, a little more CPU)."""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

import anyio
from httpcore import AsyncNetworkStream

try:
    from httpcore._backends.anyio import AnyIOBackend, AnyIOStream
    from httpcore._utils import is_socket_readable
except ImportError:  # another httpcore: the pool keeps its own backend
    HAVE_PRIVATE = False
else:
    HAVE_PRIVATE = True


def backend() -> Any:
    """This backend, or None where httpcore's private modules differ."""
    return Backend() if HAVE_PRIVATE else None


if HAVE_PRIVATE:
    class _Stream(AnyIOStream):
        def __init__(self, stream: anyio.abc.ByteStream) -> None:
            super().__init__(stream)
            self._socket: socket.socket | None = stream.extra(
                anyio.abc.SocketAttribute.raw_socket, None)

        def get_extra_info(self, info: str) -> Any:
            if info == "is_readable":
                return is_socket_readable(self._socket)
            return super().get_extra_info(info)

    class Backend(AnyIOBackend):
        """The anyio backend whose plain TCP streams check readiness on a socket found
        once."""

        async def connect_tcp(
            self, host: str, port: int, timeout: float | None = None,
            local_address: str | None = None,
            socket_options: Iterable[Any] | None = None,
        ) -> AsyncNetworkStream:
            stream = await super().connect_tcp(host, port, timeout=timeout,
                                               local_address=local_address,
                                               socket_options=socket_options)
            if not isinstance(stream, AnyIOStream):
                return stream
            return _Stream(stream._stream)
