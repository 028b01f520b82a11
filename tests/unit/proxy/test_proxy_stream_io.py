"""How a stream goes through the proxy: the client's bytes are the events, each once and
in order, however they are written (the proxy joins those queued at once into one
write), and a streamed leg leaves its connection to D in the pool (the proxy reads D's
body to its end after [DONE]; left unread, httpcore closed the connection and every
streamed leg paid a new one). P, D1 and D2 are bare HTTP engines (stubs.py)."""

from __future__ import annotations

import asyncio
import json

import httpx

from kvrelay.proxy.app import create_proxy_app
from kvrelay.proxy.routing import Proxy
from tests.unit.proxy.stubs import BODY, Engine, asked


def _event(doc: str) -> str:
    return f"data: {doc}\n\n"


def test_the_client_gets_each_event_once_in_order_byte_for_byte() -> None:
    r = asyncio.run(asked(Engine("prefill"), Engine("stream"), Engine("stream")))
    assert r.status_code == 200, r.text
    first = json.loads(r.text.split("\n\n")[0][len("data: "):])
    head = (f'{{"id":"{first["id"]}","object":"text_completion","created":{first["created"]},'
            '"model":"m","choices":')
    assert r.text == "".join([
        _event(head + '[{"index":0,"text":" a","logprobs":null,"finish_reason":null}],'
               '"usage":null}'),
        _event(head + '[{"index":0,"text":" b","logprobs":null,"finish_reason":null}],'
               '"usage":null}'),
        _event(head + '[{"index":0,"text":" c","logprobs":null,"finish_reason":"length"}],'
               '"usage":null}'),
        _event(head + '[],"usage":{"prompt_tokens":2,"completion_tokens":3,'
               '"total_tokens":5}}'),
        "data: [DONE]\n\n",
    ])


async def _two_streams(p: Engine, d1: Engine, d2: Engine) -> list[str]:
    urls = [await e.start() for e in (p, d1, d2)]
    proxy = Proxy(urls[:1], urls[1:], health_interval=3600)
    app = create_proxy_app(proxy)
    try:
        async with app.router.lifespan_context(app):
            await d2.checked.wait()  # D1's connection, its health check answered, pooled
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
                texts = []
                for _ in range(2):
                    r = await c.post("/v1/completions", json=BODY, timeout=30)
                    assert r.status_code == 200, r.text
                    texts.append(r.text)
            await asyncio.gather(*proxy._tasks)
            return texts
    finally:
        for e in (p, d1, d2):
            await e.stop()


def test_streamed_legs_reuse_the_decode_engines_connection() -> None:
    """Both legs went to D1 on the connection its health check opened: its requests 2
    and 3 there (a new connection per leg numbers each 1)."""
    p, d1, d2 = Engine("prefill"), Engine("stream"), Engine("stream")
    texts = asyncio.run(_two_streams(p, d1, d2))
    assert all(t.endswith("data: [DONE]\n\n") for t in texts)
    assert [n for _, _, n in d1.posts] == [2, 3]
    assert not d2.posts
