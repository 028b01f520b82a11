"""A small streamed load through the proxy from a thread, for the drain and discovery
tests: the official openai client, no retries (a failure is a failure)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import openai

MAX_TOKENS, CONCURRENCY = 6, 4
# Two cores shared by several engines and the test: one thread each, and leases that
# outlast a slow moment (cluster.py's 2 s is for the fault tests), so that a lease that
# expires here is a lease lost.
ENGINE_ARGS = ("--threads", "1", "--lease-timeout", "30")


class Load:
    """Streamed requests through ``url`` from a thread, ``CONCURRENCY`` at a time, until
    stopped; every answer must have its ``MAX_TOKENS`` tokens."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.done = 0
        self.failures: list[str] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the load did not stop"

    def wait_more(self, n: int, timeout: float = 60.0) -> None:
        """Wait for ``n`` more answers (an event: each answer notifies)."""
        with self._cond:
            target = self.done + n
            ok = self._cond.wait_for(lambda: self.done >= target or bool(self.failures),
                                     timeout)
        assert not self.failures, self.failures[:3]
        assert ok, f"{n} more answers not within {timeout} s ({self.done} so far)"

    async def _main(self) -> None:
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none",
                                    max_retries=0, timeout=60)
        try:
            await asyncio.gather(*(self._worker(client, w) for w in range(CONCURRENCY)))
        finally:
            await client.close()

    async def _worker(self, client: openai.AsyncOpenAI, w: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                tokens, finish = await ask_streamed(client, self.model, f"Worker {w} request {i}",
                                            chat=bool(i % 2))
                error = None if (tokens, finish) == (MAX_TOKENS, "length") else \
                    f"request {w}/{i}: {tokens} tokens, finish {finish!r}"
            except Exception as exc:  # any failure of the client's request counts
                error = f"request {w}/{i}: {type(exc).__name__}: {exc}"
            with self._cond:
                self.done += 1
                if error:
                    self.failures.append(error)
                self._cond.notify_all()


async def ask_streamed(client: openai.AsyncOpenAI, model: str, prompt: str,
               chat: bool) -> tuple[int, str]:
    kw: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                          "stream": True, "stream_options": {"include_usage": True},
                          "extra_body": {"ignore_eos": True}}
    usage, finish = -1, ""
    if chat:
        stream: Any = await client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], **kw)
    else:
        stream = await client.completions.create(prompt=prompt, **kw)
    async for ch in stream:
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
        for choice in ch.choices:
            finish = choice.finish_reason or finish
    return usage, finish


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


