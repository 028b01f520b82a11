"""Stand-ins for the model package in the server's unit tests (no tests here).

A byte-level tokenizer, a runner that writes lowercase letters (the fake runner's
deterministic tokens, shifted into a..z) and a simple stop-string detokenizer:
enough to drive the whole HTTP path with exactly predictable output.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.core.runner import Batch, SampledToken, TokenLogprobs
from kvrelay.demo import free_port
from kvrelay.server.api import ServedModel, ServerState, create_app
from kvrelay.server.engine_loop import EngineLoop
from kvrelay.server.metrics import ServerMetrics
from kvrelay.testing.fake_runner import expected_output

BOS, EOS = 256, 257
LETTERS = 26


class ByteTokenizer:
    eos_token_ids: Sequence[int] = (EOS,)
    bos_token_id: int | None = BOS
    vocab_size = 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode())

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytearray()
        for t in token_ids:
            if t < 256:
                data.append(t)
            elif not skip_special_tokens:
                data.extend(b"<s>" if t == BOS else b"</s>")
        return data.decode(errors="replace")

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class LetterRunner:
    """FakeRunner's tokens mapped to a..z (97 + token), optionally slowed down."""

    def __init__(self, delay_s: float = 0.0) -> None:
        from kvrelay.testing.fake_runner import FakeRunner

        self.inner = FakeRunner(vocab_size=LETTERS)
        self.delay_s = delay_s

    def execute(self, batch: Batch) -> Mapping[str, SampledToken]:
        if self.delay_s:
            time.sleep(self.delay_s)
        out = {}
        params = {sr.request_id: sr.params for sr in batch.requests}
        for rid, tok in self.inner.execute(batch).items():
            t = 97 + tok.token_id
            n = params[rid].logprobs
            lp = None
            if n is not None:
                top = [(t, -0.5)] + [(97 + (tok.token_id + k) % LETTERS, -1.0 - k)
                                     for k in range(1, n)]
                lp = TokenLogprobs(-0.5, top[: max(n, 1)] if n else [])
            out[rid] = SampledToken(t, lp)
        return out


def expected_letters(seed: int, prompt_len: int, max_tokens: int) -> str:
    return "".join(chr(97 + t) for t in expected_output(seed, prompt_len, max_tokens, LETTERS))


class StopDetokenizer:
    """Decodes the whole output each time; holds back a possible stop-string prefix."""

    def __init__(
        self, tokenizer: ByteTokenizer, prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer, self.stop, self.include = tokenizer, tuple(stop), include_stop_str_in_output
        self.ids: list[int] = []
        self.emitted = 0
        self.stopped = False
        self.text = ""

    def add(self, new_token_ids: Sequence[int]) -> str:
        self.ids.extend(new_token_ids)
        full = self.tokenizer.decode(self.ids)
        for s in self.stop:
            i = full.find(s)
            if i >= 0:
                self.stopped = True
                full = full[: i + len(s)] if self.include else full[:i]
                return self._emit(full, len(full))
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return self._emit(full, max(self.emitted, len(full) - hold))

    def finish(self) -> str:
        return "" if self.stopped else self._emit(self.tokenizer.decode(self.ids), None)

    def _emit(self, full: str, upto: int | None) -> str:
        end = len(full) if upto is None else upto
        delta = full[self.emitted : end]
        self.emitted = end
        self.text += delta
        return delta


def make_state(
    *, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128,
    delay_s: float = 0.0, api_key: str | None = None, async_scheduling: bool = False,
    max_num_seqs: int = 32,
) -> ServerState:
    config = SchedulerConfig(
        num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=512, async_scheduling=async_scheduling,
    )
    engine = Engine(config, LetterRunner(delay_s))
    tok = ByteTokenizer()
    model = ServedModel(
        names=["tiny", "tiny-alias"], tokenizer=tok, max_model_len=max_model_len,
        max_context=min(max_model_len, num_blocks * block_size),
        make_detokenizer=lambda ids, p: StopDetokenizer(tok, ids, p.stop,
                                                        p.include_stop_str_in_output),
    )
    return ServerState(EngineLoop(engine), model, ServerMetrics(engine, "tiny"), api_key)


@contextlib.contextmanager
def serve_in_thread(state: ServerState) -> Iterator[str]:
    """Run the app with uvicorn in a thread; yields the base URL."""
    port = free_port()
    config = uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def wait_serving(url: str, proc: subprocess.Popen[Any], log: Path | None = None) -> None:
    """Wait (30 s at most) until a ``kvrelay serve`` child answers /health 200 (its
    ``log`` shown when it does not)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            assert time.monotonic() < deadline and proc.poll() is None, (
                log.read_text() if log else "")
            time.sleep(0.05)


def stream_in_flight(url: str, body: dict[str, Any],
                     timeout: float) -> tuple[list[str], threading.Thread]:
    """Start a streamed completion on a thread and return (its lines so far, the thread)
    once its first event came: in flight, not merely sent (on a busy machine a signal
    sent after a sleep once came before the stream connected)."""
    lines: list[str] = []
    first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(30), "the stream never started"
    return lines, t
