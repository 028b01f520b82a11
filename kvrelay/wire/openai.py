"""OpenAI request models, error bodies and response pieces.

Requests are parsed with pydantic; every failure becomes an ``ApiError`` whose
body is the OpenAI shape ``{"error": {"message", "type", "param", "code"}}`` with
``param`` naming the offending field (``messages[0].content``, ``temperature``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from kvrelay.core.runner import TokenLogprobs
from kvrelay.sampling_params import InvalidParameter, SamplingParams, StructuredOutput
from kvrelay.wire.http import bad_request
from kvrelay.wire.schema import structured_output
from kvrelay.wire.tools import ToolPlan, plan_tools

MAX_N = 16
MAX_CHOICES = 64  # prompts in a batch times n
MAX_TOP_LOGPROBS = 20
MAX_BAD_WORDS = 128
_GUIDED = ("vLLM's guided decoding parameters are not supported: use response_format "
           "json_object or json_schema")


# -- requests -------------------------------------------------------------------------
class _Strict(BaseModel):
    # Unknown fields are ignored (as vLLM does), so newer clients keep working.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: str
    # {"name", "schema", "strict", "description"} as OpenAI sends it.
    json_schema: dict[str, Any] | None = None

    def structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return structured_output("json_object", '{"type": "object"}')
        if self.type == "json_schema":
            spec = self.json_schema or {}
            schema = spec.get("schema")
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema",
                                  "response_format json_schema needs json_schema.schema, an object")
            # Key order kept: the output's properties come in the schema's order.
            return structured_output("json_schema", json.dumps(schema))
        raise bad_request("response_format.type", "response_format.type must be text, "
                          f"json_object or json_schema, got {self.type!r}")


class _SamplingRequest(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Disaggregation: {"do_remote_decode": true} on a prefill engine, the lease
    # (from the prefill engine's answer) on a decode engine.
    kv_transfer_params: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extra sampling parameters.
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    user: str | None = None

    # Fields of OpenAI's and vLLM's APIs that change what is generated and that kvrelay
    # does not implement: a 400 naming them unless sent with the value meaning "off"
    # (clients send defaults explicitly). Each: field -> (is it off?, what to say).
    REFUSED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "best_of": (lambda v: v is None or v == 1, "best_of > 1 is not supported"),
        "use_beam_search": (lambda v: not v, "beam search is not supported"),
        "length_penalty": (lambda v: v is None or v == 1.0,
                           "length_penalty (a beam search parameter) is not supported"),
        "early_stopping": (lambda v: not v,
                           "early_stopping (a beam search parameter) is not supported"),
        "truncate_prompt_tokens": (lambda v: v is None,
                                   "truncate_prompt_tokens is not supported"),
        "logits_processors": (lambda v: not v, "logits_processors are not supported"),
        "return_tokens_as_token_ids": (lambda v: not v,
                                       "return_tokens_as_token_ids is not supported"),
        "skip_special_tokens": (lambda v: v is None or v is True,
                                "skip_special_tokens=false is not supported"),
        "spaces_between_special_tokens": (lambda v: v is None or v is True,
                                          "spaces_between_special_tokens=false is not "
                                          "supported"),
        "structured_outputs": (lambda v: v is None, _GUIDED),
        "guided_json": (lambda v: v is None, _GUIDED),
        "guided_regex": (lambda v: v is None, _GUIDED),
        "guided_choice": (lambda v: v is None, _GUIDED),
        "guided_grammar": (lambda v: v is None, _GUIDED),
        "structural_tag": (lambda v: v is None, _GUIDED),
        "guided_whitespace_pattern": (lambda v: v is None, _GUIDED),
        "priority": (lambda v: not v, "request priorities are not supported"),
    }
    # Known fields with no effect on the output here: dropped without a warning.
    HARMLESS: ClassVar[frozenset[str]] = frozenset({
        "store", "metadata", "service_tier", "request_id",
        "guided_decoding_backend", "cache_salt",
    })

    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_common(self) -> None:
        if self.bad_words is not None and len(self.bad_words) > MAX_BAD_WORDS:
            raise bad_request("bad_words", f"at most {MAX_BAD_WORDS} bad_words are allowed, "
                              f"got {len(self.bad_words)}")
        if any(not w.strip() for w in self.bad_words or ()):
            raise bad_request("bad_words", "bad_words cannot contain an empty string")
        if not 1 <= self.n <= MAX_N:
            raise bad_request("n", f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "stream_options is only allowed with stream=true")

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, index: int,
        bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
    ) -> SamplingParams:
        """Params of choice ``index``; with a seed, choice i samples with seed + i."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                seed=None if self.seed is None else self.seed + index,
                stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias=self.logit_bias_pairs(),
                structured=self.structured(),
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                min_tokens=self.min_tokens,
                bad_words_token_ids=bad_words_token_ids,
                allowed_token_ids=(None if self.allowed_token_ids is None
                                   else tuple(self.allowed_token_ids)),
                prompt_logprobs=self.num_prompt_logprobs(),
            )
        except InvalidParameter as exc:
            raise bad_request(exc.param, str(exc)) from exc


    def num_prompt_logprobs(self) -> int | None:
        return None

    def structured(self) -> StructuredOutput | None:
        return self.response_format.structured() if self.response_format else None

    def bad_words_token_ids(self, encode: Callable[[str], list[int]]
                            ) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of bad_words: each word as written (leading spaces
        stripped), and with one leading space where that is another token sequence of
        the same length (the word in the middle of a text)."""
        out: list[tuple[int, ...]] = []
        for word in self.bad_words or ():
            plain = tuple(encode(word.lstrip()))
            if not plain:
                raise bad_request("bad_words", f"bad_words entry {word!r} has no tokens")
            out.append(plain)
            spaced = tuple(encode(" " + word.lstrip()))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return tuple(out)

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias} as (id, bias) pairs; keys must be integers."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise bad_request("logit_bias", f"logit_bias keys are token ids, got {key!r}")
            pairs.append((int(key), bias))
        return tuple(pairs)


def check_prompt_logprobs(n: int | None, stream: bool) -> None:
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise bad_request("prompt_logprobs", "prompt_logprobs must be between 0 and "
                          f"{MAX_TOP_LOGPROBS}, got {n}")
    if stream and n:
        raise bad_request("prompt_logprobs", "prompt_logprobs are not available with "
                          "stream=true (vLLM's rule: only 0 is)")


PromptInput = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptInput
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text prompt
    prompt_logprobs: int | None = None  # vLLM's

    def num_prompt_logprobs(self) -> int | None:
        """Prompt logprobs to compute: vLLM's prompt_logprobs, or echo with logprobs (the
        prompt's tokens come back with theirs, as lm-evaluation-harness scores them). A
        stream shows no prompt_logprobs field (vLLM takes only 0 there)."""
        shown = None if self.stream else self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, shown or 0)
        return shown

    @property
    def shows_prompt_logprobs(self) -> bool:
        """The answer carries vLLM's prompt_logprobs field (never a stream's)."""
        return self.prompt_logprobs is not None and not self.stream

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs), nothing generated."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string, a token list, or a list of either."""
        p = self.prompt
        if isinstance(p, str):
            batch: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            batch = [p]  # type: ignore[list-item]
        else:
            batch = list(p)  # type: ignore[arg-type]
        if not batch:
            raise bad_request("prompt", "prompt must not be empty")
        if len(batch) * self.n > MAX_CHOICES:
            raise bad_request(
                "prompt", f"a batch of {len(batch)} prompts with n={self.n} makes "
                f"{len(batch) * self.n} choices; at most {MAX_CHOICES} are allowed",
            )
        for i, item in enumerate(batch):
            if len(item) == 0:
                where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
                raise bad_request(where, f"{where} is empty; at least one token is required")
        return batch

    def check(self) -> None:
        self.check_common()
        check_prompt_logprobs(self.prompt_logprobs, self.stream)
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens", "max_tokens must be >= 1 (0 only with echo)")
        if self.suffix:
            raise bad_request("suffix", "suffix (fill-in-the-middle) is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(
                "logprobs",
                f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}",
            )


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required, may be null (assistant turns); an assistant turn with tool_calls may leave
    # it out (OpenAI's clients do).
    content: str | list[TextPart] | None
    # Earlier tool turns of a conversation reach the chat template as sent.
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _calls_without_content(cls, data: Any) -> Any:
        if isinstance(data, dict) and "content" not in data and data.get("tool_calls"):
            return {**data, "content": None}
        return data

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_special_tokens: bool = False  # vLLM's: the template already holds them
    prompt_logprobs: int | None = None  # vLLM's: the answer's top-level prompt_logprobs
    # Set by check(): the validated tools and the grammar that forces a call.
    _tools: ToolPlan | None = PrivateAttr(default=None)
    _forced: StructuredOutput | None = PrivateAttr(default=None)

    REFUSED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **_SamplingRequest.REFUSED,
        "echo": (lambda v: not v, "echo (of the last message) is not supported"),
        "continue_final_message": (lambda v: not v, "continue_final_message is not supported"),
        "add_generation_prompt": (lambda v: v is None or v is True,
                                  "add_generation_prompt=false is not supported"),
        "chat_template": (lambda v: v is None, "a request's own chat_template is not "
                          "supported (the model's is used)"),
        "chat_template_kwargs": (lambda v: not v, "chat_template_kwargs are not supported"),
        "documents": (lambda v: not v, "documents are not supported"),
        "mm_processor_kwargs": (lambda v: not v, "multimodal inputs are not supported"),
        "functions": (lambda v: not v, "functions are not supported"),
        "function_call": (lambda v: v is None or v == "none", "function_call is not supported"),
        "audio": (lambda v: v is None, "audio output is not supported"),
        "modalities": (lambda v: v is None or v == ["text"], "only the text modality is "
                       "supported"),
        "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    }

    def check(self) -> None:
        self.check_common()
        try:
            self._tools = plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
            self._forced = self._tools.structured() if self._tools else None
        except InvalidParameter as exc:
            raise bad_request(exc.param, str(exc)) from exc
        if self._forced is not None and self.response_format is not None and (
                self.response_format.type != "text"):
            raise bad_request("response_format", "response_format cannot be combined with "
                              "tool_choice \"required\" or a named function (the tools' "
                              "schemas shape the output)")
        if not self.messages:
            raise bad_request("messages", "messages must contain at least one message")
        check_prompt_logprobs(self.prompt_logprobs, self.stream)
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs", "top_logprobs requires logprobs=true")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad_request(
                    "top_logprobs",
                    f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, "
                    f"got {self.top_logprobs}",
                )

    @property
    def tool_plan(self) -> ToolPlan | None:
        """The request's tools, as ``check`` validated them."""
        return self._tools

    def structured(self) -> StructuredOutput | None:
        return self._forced if self._forced is not None else super().structured()

    def parses_tools(self) -> bool:
        """The answer is read for tool calls: the whole output must be in one place."""
        return self._tools is not None and self._tools.mode != "none"

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def num_prompt_logprobs(self) -> int | None:
        return None if self.stream else self.prompt_logprobs

    @property
    def shows_prompt_logprobs(self) -> bool:
        return self.num_prompt_logprobs() is not None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens
        )

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        for key in ("name", "tool_call_id", "tool_calls"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        out.append(msg)
    return out


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a ``prompt`` (completions) or ``messages`` (chat, through
    the model's template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Default: True for a prompt (the BOS a completion gets), False for messages (the
    # template holds them), as vLLM.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None  # rendered by the template, as on chat

    REFUSED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "continue_final_message": (lambda v: not v, "continue_final_message is not supported"),
        "chat_template": (lambda v: v is None, "a request's own chat_template is not "
                          "supported (the model's is used)"),
        "chat_template_kwargs": (lambda v: not v, "chat_template_kwargs are not supported"),
        "return_token_strs": (lambda v: not v, "return_token_strs is not supported"),
    }

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("prompt", "send exactly one of prompt (a string) and messages")
        if self.messages is not None and not self.messages:
            raise bad_request("messages", "messages must contain at least one message")

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages or [])

    def checked_tools(self) -> tuple[dict[str, Any], ...] | None:
        """The tools the template renders (validated as chat's are), as vLLM's /tokenize
        takes them."""
        try:
            plan = plan_tools(self.tools, "none", None)
        except InvalidParameter as exc:
            raise bad_request(exc.param, str(exc)) from exc
        return None if plan is None else plan.tools


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# -- responses ------------------------------------------------------------------------


class LogprobFormatter:
    """OpenAI logprobs objects from ``TokenLogprobs`` (one per sampled token)."""

    def __init__(self, token_text: Any) -> None:
        self._text = token_text  # token id -> its text

    def token_text(self, token_id: int) -> str:
        return str(self._text(token_id))

    def completion(
        self, token_ids: Sequence[int], lps: Sequence[TokenLogprobs], offset: int
    ) -> dict[str, Any]:
        tokens = [self._text(t) for t in token_ids]
        offsets = []
        pos = offset
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def echoed(
        self, prompt_ids: Sequence[int], prompt_lps: Sequence[TokenLogprobs],
        output: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """echo with logprobs, as vLLM lays it out: the prompt's tokens first (the first
        one's logprob null: nothing predicts it), then the output's (``output``, made by
        ``completion`` with the offset where the prompt's token texts end)."""
        tokens = [self._text(t) for t in prompt_ids]
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        lp: dict[str, Any] = {
            "tokens": tokens,
            "token_logprobs": [None, *(p.logprob for p in prompt_lps)],
            "top_logprobs": [None, *({self._text(t): v for t, v in p.top} for p in prompt_lps)],
            "text_offset": offsets,
        }
        if output is not None:
            for key in lp:
                lp[key] = lp[key] + output[key]
        return lp

    def prompt_logprobs(
        self, prompt_ids: Sequence[int], lps: Sequence[TokenLogprobs]
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token, {token id: {logprob, rank,
        decoded_token}} for the token and its top alternatives; null for the first."""
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for tok, lp in zip(prompt_ids[1:], lps, strict=True):
            entry = {str(tok): {"logprob": lp.logprob, "rank": lp.rank,
                                "decoded_token": self._text(tok)}}
            for rank, (t, v) in enumerate(lp.top, start=1):
                entry.setdefault(str(t), {"logprob": v, "rank": rank,
                                          "decoded_token": self._text(t)})
            out.append(entry)
        return out

    def chat(self, token_ids: Sequence[int], lps: Sequence[TokenLogprobs]) -> dict[str, Any]:
        return {"content": [self._chat_entry(t, lp) for t, lp in zip(token_ids, lps, strict=True)]}

    def _chat_entry(self, token_id: int, lp: TokenLogprobs) -> dict[str, Any]:
        text = self._text(token_id)
        return {
            "token": text,
            "logprob": lp.logprob,
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": (s := self._text(t)), "logprob": v, "bytes": list(s.encode())}
                for t, v in lp.top
            ],
        }


