"""The OpenAI-compatible HTTP API.

``create_app`` takes everything it serves as arguments (the engine loop, the
model's tokenizer and limits, a detokenizer factory), so tests can inject
stand-ins and the prefill/decode roles can reuse the same request path.

Request path: parse and validate (ApiError names the field) -> tokenize ->
``Generation.start`` (the engine accepts or rejects each choice) -> stream or
collect ``Delta``s. Whatever ends the handler (done, error, client gone, shutdown),
``Generation.abort_unfinished`` runs in a ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvrelay import __version__, env
from kvrelay.model.interface import Tokenizer
from kvrelay.model.text.tokenizer import ChatTemplateError
from kvrelay.relay.release_keys import ReleaseKeys
from kvrelay.relay.resolve import RelayResolver
from kvrelay.server.bodies import (
    ChatShape,
    CompletionShape,
    Echo,
    EchoShape,
    Shape,
    ToolChatShape,
    collect,
    stream_events,
)
from kvrelay.server.engine_loop import EngineLoop
from kvrelay.server.generation import ChoiceSpec, DetokenizerFactory, Generation
from kvrelay.server.leases import Leases
from kvrelay.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from kvrelay.server.responses_api import ResponsesRoute
from kvrelay.wire.drain import DrainState
from kvrelay.wire.http import (
    ApiError,
    bad_request,
    install_error_handlers,
    new_id,
    now,
    parse_body,
    read_body,
    usage,
)
from kvrelay.wire.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LogprobFormatter,
    TokenizeRequest,
)
from kvrelay.wire.sse import EventStream, until_disconnect
from kvrelay.wire.tools import describe_tools, hermes_calls_text, parser

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """What the API needs of the model."""

    names: list[str]  # served model names; the first is reported
    tokenizer: Tokenizer
    max_model_len: int
    # Most tokens one request can hold: min(max_model_len, KV cache capacity).
    max_context: int
    make_detokenizer: DetokenizerFactory
    block_size: int | None = None  # KV block size (validates a lease's block count)
    created: int = field(default_factory=now)

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass
class ServerState:
    loop: EngineLoop
    model: ServedModel
    metrics: ServerMetrics
    api_key: str | None = None
    role: str = "both"  # "prefill" | "decode" | "both" (colocated)
    # Prefill role: gives a lease back when the client left before the decode engine.
    release_lease: Callable[[str, str], dict[str, Any]] | None = None
    # Prefill role: leases by the proxy's release_key (kvrelay.relay.release_keys).
    release_keys: ReleaseKeys | None = None
    # --tool-call-parser when --enable-auto-tool-choice: tool_choice auto is served.
    tool_parser: str | None = None
    drain: DrainState = field(default_factory=DrainState)  # set going by SIGTERM
    # --kv-events-config: where this engine publishes its KV events (GET /v1/kv/events).
    kv_events: dict[str, Any] | None = None


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(state.loop.stop)

    app = FastAPI(title="kvrelay", version=__version__, lifespan=lifespan)
    app.state.kvrelay = state
    install_error_handlers(app)
    handlers = _Handlers(state)

    app.add_api_route("/health", handlers.health, methods=["GET"])
    app.add_api_route("/version", handlers.version, methods=["GET"])
    app.add_api_route("/metrics", handlers.metrics, methods=["GET"])
    app.add_api_route("/v1/models", handlers.models, methods=["GET"])
    app.add_api_route("/v1/completions", handlers.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", handlers.chat_completions, methods=["POST"])
    app.add_api_route("/v1/responses", ResponsesRoute(handlers).create, methods=["POST"])
    app.add_api_route("/v1/kv/release", handlers.leases.release, methods=["POST"])
    app.add_api_route("/v1/kv/events", handlers.kv_events, methods=["GET"])
    app.add_api_route("/tokenize", handlers.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", handlers.detokenize, methods=["POST"])
    return app


class _Handlers:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.model = state.model
        tok = state.model.tokenizer
        self.logprobs = LogprobFormatter(lambda t: tok.decode([t], skip_special_tokens=False))
        self.leases = Leases(state, self._check_auth)
        # Decode role: a relay host name keyed by its address (kvrelay.relay.resolve).
        self._resolver = RelayResolver() if state.role == "decode" else None

    # -- plain endpoints -------------------------------------------------------------
    async def health(self) -> Response:
        drain = self.state.drain
        if drain.draining:
            return JSONResponse({"status": "draining", **drain.error_body()}, status_code=503,
                                headers=drain.headers())
        if not self.state.loop.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def version(self) -> Response:
        return JSONResponse({"version": __version__})

    async def metrics(self) -> Response:
        # Relay samples are read under the engine lock: off the event loop.
        body = await asyncio.to_thread(self.state.metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def kv_events(self, request: Request) -> Response:
        """Where this engine publishes its KV events (kvrelay proxy --kv-events reads it)."""
        self._check_auth(request)
        if self.state.kv_events is None:
            raise ApiError(404, "this engine publishes no KV events (start it with "
                           "--kv-events-config)", code="kv_events_off", type="not_found_error")
        return JSONResponse(self.state.kv_events)

    async def models(self, request: Request) -> Response:
        self._check_auth(request)
        m = self.model
        data = [
            {
                "id": name, "object": "model", "created": m.created, "owned_by": "kvrelay",
                "root": m.name, "max_model_len": m.max_model_len,
            }
            for name in m.names
        ]
        return JSONResponse({"object": "list", "data": data})

    # -- generation endpoints --------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        self._check_auth(request)
        body = parse_body(await read_body(request), CompletionRequest)
        self._check_model(body.model)
        body.check()
        raw = body.prompts()
        prompts = [self._encode_prompt(p, body.add_special_tokens) for p in raw]
        # echo with max_tokens 0: one token is generated and left out of the answer.
        max_tokens = 1 if body.echo_only else body.max_tokens
        specs = await self._resolved(self._specs(body, prompts, max_tokens, body.logprobs))
        self._check_extras(specs)
        gen = self._generation("cmpl", {}, arrival, body.kv_transfer_params)
        await gen.start(specs, sum(len(p) for p in prompts))
        shape: CompletionShape = CompletionShape(gen.base_id, self.model.name,
                                                 body.logprobs is not None, self.logprobs)
        if body.echo or body.shows_prompt_logprobs:
            tok = self.model.tokenizer
            texts = [p if isinstance(p, str) else tok.decode(ids, skip_special_tokens=False)
                     for p, ids in zip(raw, prompts, strict=True)]
            echo = Echo(list(zip(prompts, texts, strict=True)), body.n, body.echo,
                        body.echo_only, body.shows_prompt_logprobs)
            shape = EchoShape(gen.base_id, self.model.name, body.logprobs is not None,
                              self.logprobs, echo)
        return await self._respond(request, gen, shape, body.stream,
                                   body.include_usage_in_stream(), len(specs))

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        self._check_auth(request)
        body = parse_body(await read_body(request), ChatCompletionRequest)
        self._check_model(body.model)
        body.check()
        plan = body.tool_plan
        if plan is not None and plan.mode == "auto" and self.state.tool_parser is None:
            # vLLM's answer, word for word.
            raise bad_request("tool_choice", "\"auto\" tool choice requires "
                              "--enable-auto-tool-choice and --tool-call-parser to be set")
        prompt = self._render_chat(body)
        specs = await self._resolved(
            self._specs(body, [prompt], body.requested_max_tokens(), body.num_logprobs()))
        self._check_extras(specs)
        gen = self._generation("chatcmpl", {"prompt": "messages"}, arrival,
                               body.kv_transfer_params)
        await gen.start(specs, len(prompt))
        shape: ChatShape = ChatShape(gen.base_id, self.model.name, body.logprobs, self.logprobs)
        if plan is not None and plan.mode != "none":
            auto = parser(self.state.tool_parser) if self.state.tool_parser else None
            shape = ToolChatShape(gen.base_id, self.model.name, body.logprobs, self.logprobs,
                                  plan, auto)
        if body.shows_prompt_logprobs:
            shape.prompt_ids = prompt
        return await self._respond(request, gen, shape, body.stream,
                                   body.include_usage_in_stream(), len(specs))

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: a prompt or chat messages to token ids."""
        self._check_auth(request)
        body = parse_body(await read_body(request), TokenizeRequest)
        if body.model is not None:
            self._check_model(body.model)
        body.check()
        tok = self.model.tokenizer
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tok.encode(body.prompt, add_special_tokens=special)
        else:
            ids = self._render(body.template_messages(), body.add_generation_prompt,
                               bool(body.add_special_tokens), body.checked_tools())
        return JSONResponse({"count": len(ids), "max_model_len": self.model.max_model_len,
                             "tokens": ids, "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: token ids to text (special tokens kept, as vLLM)."""
        self._check_auth(request)
        body = parse_body(await read_body(request), DetokenizeRequest)
        if body.model is not None:
            self._check_model(body.model)
        vocab = self.model.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request("tokens", f"token id {bad} is outside [0, {vocab})")
        text = self.model.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    # -- helpers ---------------------------------------------------------------------
    def _render_chat(self, body: ChatCompletionRequest) -> list[int]:
        plan = body.tool_plan
        return self._render(body.template_messages(), True, body.add_special_tokens,
                            plan.tools if plan is not None else None)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                add_special_tokens: bool, tools: Sequence[dict[str, Any]] | None = None
                ) -> list[int]:
        tok = self.model.tokenizer
        template = getattr(tok, "chat_template", None) or ""
        messages = tool_messages(messages, tools, template)
        if tools is not None and "tools" not in template:
            tools = None  # described in a system message instead
        try:
            # tools only when there are some: a tokenizer without tool support still serves.
            extra = {} if tools is None else {"tools": tools}
            text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           **extra)
        except ChatTemplateError as exc:
            raise bad_request("messages", f"the model's chat template refused the "
                              f"messages: {exc}") from exc
        return tok.encode(text, add_special_tokens=add_special_tokens)

    def _check_extras(self, specs: Sequence[ChoiceSpec]) -> None:
        """logit_bias ids inside the vocabulary (all choices share them). A
        response_format schema was checked when its SamplingParams were built."""
        vocab = self.model.tokenizer.vocab_size
        p = specs[0].params
        for param, ids in (("logit_bias", [t for t, _ in p.logit_bias]),
                           ("allowed_token_ids", p.allowed_token_ids or ())):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(param, f"{param} token id {bad} is outside [0, {vocab})")
    def _check_auth(self, request: Request) -> None:
        key = self.state.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if not header:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           param="Authorization", code="invalid_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), key):
            raise ApiError(401, "incorrect API key provided", param="Authorization",
                           code="invalid_api_key")

    def _check_model(self, name: str) -> None:
        if name not in self.model.names:
            raise ApiError(
                404, f"the model {name!r} does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.model.names)}",
                param="model", code="model_not_found",
            )

    def _encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True
                       ) -> list[int]:
        if isinstance(prompt, str):
            return self.model.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        vocab = self.model.tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request("prompt", f"prompt token id {bad} is outside [0, {vocab})")
        return list(prompt)

    def _specs(
        self, body: Any, prompts: Sequence[list[int]], max_tokens: int | None,
        logprobs: int | None,
    ) -> list[ChoiceSpec]:
        remote_decode, remote_kv = self.leases.kv_mode(body, len(prompts))
        tok = self.model.tokenizer
        bad_words = body.bad_words_token_ids(lambda w: tok.encode(w, add_special_tokens=False))
        specs = []
        for p_index, prompt in enumerate(prompts):
            # Unset max_tokens: as many as the context still holds (the engine rejects a
            # prompt that leaves no room, naming the prompt).
            limit = max_tokens if max_tokens is not None else max(
                1, self.model.max_context - len(prompt)
            )
            for i in range(body.n):
                index = p_index * body.n + i
                params = body.sampling_params(limit, logprobs, i, bad_words)
                specs.append(ChoiceSpec(index, prompt, params, remote_decode, remote_kv))
        return specs

    async def _resolved(self, specs: list[ChoiceSpec]) -> list[ChoiceSpec]:
        """Specs whose lease names its relay by host name, named by address instead: one
        relay, one key (one sender, one pool, one of P's slots) however it is spelled."""
        kv = specs[0].remote_kv if specs else None  # one prompt, n=1 (Leases.kv_mode)
        if kv is None or self._resolver is None:
            return specs
        try:
            relay = await self._resolver.resolve(kv.relay)
        except ValueError as exc:
            raise bad_request("kv_transfer_params", f"invalid kv_transfer_params: {exc}") \
                from exc
        if relay != kv.relay:
            specs[0].remote_kv = dataclasses.replace(kv, relay=relay)
        return specs

    def _generation(
        self, prefix: str, param_names: dict[str, str], arrival: float,
        kv_params: dict[str, Any] | None = None,
    ) -> Generation:
        s = self.state
        gen = Generation(
            s.loop, s.metrics, s.model.make_detokenizer, new_id(prefix),
            eos_token_ids=list(s.model.tokenizer.eos_token_ids), param_names=param_names,
            arrival=arrival,
        )
        key = (kv_params or {}).get("release_key")
        if s.release_keys is not None and isinstance(key, str):  # checked by kv_mode
            gen.on_lease = self.leases.on_lease(key)
        return gen

    async def _respond(
        self, request: Request, gen: Generation, shape: Shape, stream: bool,
        include_usage: bool, num_choices: int,
    ) -> Response:
        if stream:
            return EventStream(stream_events(gen, shape, include_usage, num_choices),
                               on_close=gen.abort_unfinished)
        try:
            collected = await until_disconnect(request, collect(gen, num_choices))
        finally:
            gen.abort_unfinished()
        if collected is None:  # the client went away; nobody reads this
            await self.leases.release_unclaimed(gen)
            return Response(status_code=499)
        if (delay := _fault_answer_delay_s()) and self.state.release_keys is not None:
            await asyncio.sleep(delay)
        return JSONResponse(shape.full(collected, usage(
            gen.prompt_tokens, shape.completion_tokens(gen.completion_tokens))))


def _fault_answer_delay_s() -> float:
    """Fault injection for real-process tests: ``KVRELAY_FAULT_ANSWER_DELAY_S=S`` makes a
    prefill engine wait S seconds between making a lease and writing its answer, so a
    test can make the proxy's client leave just then (the proxy never reads the lease
    id: only its release_key gives the lease back). Unset, it costs nothing."""
    delay: float = env.get("KVRELAY_FAULT_ANSWER_DELAY_S")
    return delay


def tool_messages(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                  template: str) -> list[dict[str, Any]]:
    """Messages for a template that ignores tools (as SmolLM2's): the tools described
    in the system message (Hermes' format, as vLLM's tool templates do), earlier calls
    as ``<tool_call>`` text. A template that knows ``tools``/``tool_calls`` gets them."""
    out = [dict(m) for m in messages]
    for m in out:
        calls = m.pop("tool_calls", None)
        if not calls:
            continue
        if "tool_calls" in template:
            m["tool_calls"] = [_args_as_object(c) for c in calls]
        else:
            m["content"] = "\n".join(p for p in (m.get("content") or "",
                                                 hermes_calls_text(calls)) if p)
    if tools and "tools" not in template:
        text = describe_tools(tuple(tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}"
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _args_as_object(call: Any) -> Any:
    """OpenAI sends ``function.arguments`` as JSON text; templates (Qwen's, Llama's)
    write it with ``tojson``: given as an object, as vLLM and transformers do."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}
