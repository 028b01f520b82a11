"""Per-request sampling and stopping parameters, validated on construction.

Errors name the field and what is allowed, so the server can turn them into an
OpenAI-style 400 with ``param`` set (``InvalidParameter.param``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_K = 2**31 - 1


class InvalidParameter(ValueError):
    """A request parameter is out of range; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the output to JSON: ``json_object`` (any object) or ``json_schema``.

    An opaque, already validated spec: ``grammar`` is the compiled grammar the model's
    grammar engine runs, made by ``kvrelay.wire.schema.structured_output`` (the
    server and the model compile; the core, which carries this through
    SamplingParams, imports neither: docs/DESIGN.md, "Layers"). ``schema`` is the JSON
    Schema as JSON text, kept for messages."""

    kind: str  # "json_object" | "json_schema"
    schema: str
    grammar: str

    def __post_init__(self) -> None:
        _check(
            self.kind in ("json_object", "json_schema"),
            "response_format",
            f"response_format type must be json_object or json_schema, got {self.kind!r}",
        )
        _check(bool(self.grammar), "response_format",
               "a structured output spec needs its compiled grammar "
               "(kvrelay.wire.schema.structured_output makes one)")


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop, in the spirit of vLLM's ``SamplingParams``.

    ``seed``: with a seed, the token at output position i depends only on the seed,
    i and the logits, so the same request gives the same tokens on any engine and in
    any batch (colocated or disaggregated).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives; 0 = only the chosen token
    include_stop_str_in_output: bool = False
    # (token id, bias added to its logit), as OpenAI's logit_bias; -100..100.
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None
    # vLLM's penalties: presence and frequency over the output tokens, repetition over
    # prompt and output (positive logits divided by it, negative ones multiplied).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # EOS and stop_token_ids are masked until this many tokens are out.
    min_tokens: int = 0
    # vLLM's bad_words, tokenized (the server does it): the last token of a sequence is
    # banned where the output so far ends with the tokens before it.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Only these tokens may be sampled (None: any).
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's prompt_logprobs: the logprob of every prompt token after the first, with
    # this many top alternatives (0: only the token). Such a request skips the prefix
    # cache: every prompt position is computed.
    prompt_logprobs: int | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in pairs))
        object.__setattr__(
            self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids)
        )
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        _check(
            self.max_tokens >= 1, "max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}"
        )
        _check(
            0.0 <= self.temperature <= 2.0,
            "temperature",
            f"temperature must be in [0, 2], got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(  # bounded: a top_k past int64 failed the whole batch's model step
            self.top_k == -1 or 0 <= self.top_k <= MAX_TOP_K,
            "top_k",
            f"top_k must be -1, 0 (disabled) or a positive integer up to {MAX_TOP_K}, "
            f"got {self.top_k}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            "logprobs",
            f"logprobs must be between 0 and 20, got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "stop must be a list of non-empty strings",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "stop_token_ids must be non-negative integers",
        )
        _check(
            all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
            "logit_bias",
            "logit_bias maps token ids (>= 0) to a bias between -100 and 100",
        )

        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}")
        rep = self.repetition_penalty
        _check(math.isfinite(rep) and rep > 0.0, "repetition_penalty",
               f"repetition_penalty must be a finite number > 0, got {rep}")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        _check(
            all(w and all(t >= 0 for t in w) for w in self.bad_words_token_ids),
            "bad_words",
            "bad_words must be non-empty token sequences of non-negative ids",
        )
        allowed = self.allowed_token_ids
        _check(
            allowed is None or (len(allowed) > 0 and all(t >= 0 for t in allowed)),
            "allowed_token_ids",
            "allowed_token_ids must be a non-empty list of non-negative token ids",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Frequency, presence or repetition penalty: the sampler keeps token counts."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def needs_history(self) -> bool:
        """The sampler must see this request's tokens (penalties, min_tokens, bad words)."""
        return self.penalized or self.min_tokens > 0 or bool(self.bad_words_token_ids)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, message)
