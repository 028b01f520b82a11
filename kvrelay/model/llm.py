"""The offline API, after vLLM's: ``LLM(model).generate(prompts, params)`` and ``.chat``.

``LLM`` drives the engine core with the loaded model's runner in this thread. Stop
strings are the detokenizer's business: when it reports a match, the request is
aborted in the engine with reason STOP (its blocks are released the usual way).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.core.engine import RequestOutput as EngineOutput
from kvrelay.core.lifecycle import FinishReason
from kvrelay.core.runner import TokenLogprobs
from kvrelay.model.loader import Model, load_model
from kvrelay.model.text.detokenizer import IncrementalDetokenizer
from kvrelay.sampling_params import SamplingParams

Prompt = str | Sequence[int]  # text, or token ids
Messages = Sequence[dict[str, str]]
# Called with (index of the prompt in the call, new text) as text streams out.
OnText = Callable[[int, str], None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class _Live:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_gb: float | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        quantization: str = "auto",
        kv_cache_dtype: str = "auto",
    ) -> None:
        """``model``: a GGUF file or Hugging Face directory; None = the embedded default."""
        self.model: Model = load_model(
            model,
            dtype=dtype,
            device=device,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_memory_gb=kv_cache_memory_gb,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.tokenizer = self.model.tokenizer
        config = SchedulerConfig(
            num_blocks=self.model.num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.model.max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            prefix_cache_salt=self.model.kv_geometry.compat_hash(self.model.name),
        )
        self.engine = Engine(config, self.model.runner)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_text: OnText | None = None,
    ) -> list[RequestOutput]:
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch))
        texts = [p if isinstance(p, str) else None for p in batch]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        return self._run(texts, ids, params, on_text)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        on_text: OnText | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation and generate the reply."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt)  # type: ignore[arg-type]
            for c in convs
        ]
        # The template already writes any special tokens (bos included) itself.
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        params = _per_prompt(sampling_params, len(convs))
        return self._run(list[str | None](texts), ids, params, on_text)

    def _run(
        self,
        texts: list[str | None],
        ids: list[list[int]],
        params: list[SamplingParams],
        on_text: OnText | None,
    ) -> list[RequestOutput]:
        live: dict[str, _Live] = {}
        try:
            for i, (prompt_ids, p) in enumerate(zip(ids, params, strict=True)):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(
                    rid, prompt_ids, p, eos_token_ids=self.tokenizer.eos_token_ids
                )
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_ids, p.stop, p.include_stop_str_in_output,
                    p.min_tokens,
                )
                live[rid] = _Live(i, detok, logprobs=[] if p.logprobs is not None else None)
            while any(s.finish_reason is None for s in live.values()):
                for out in self.engine.step():
                    self._apply(live, out, on_text)
        finally:
            for rid, s in live.items():
                if s.finish_reason is None:  # interrupted: free what we admitted
                    self.engine.abort_request(rid)
            while self.engine.has_work():
                self.engine.step()
        return [
            RequestOutput(
                rid,
                texts[s.index],
                ids[s.index],
                [CompletionOutput(0, s.detok.text, s.token_ids, s.finish_reason, s.logprobs)],
            )
            for rid, s in live.items()
        ]

    def _apply(self, live: dict[str, _Live], out: EngineOutput, on_text: OnText | None) -> None:
        s = live.get(out.request_id)
        if s is None or s.finish_reason is not None:
            return  # the engine's terminal output after our stop-string abort
        s.token_ids += out.new_token_ids
        if s.logprobs is not None and out.new_logprobs:
            s.logprobs += out.new_logprobs
        delta = s.detok.add(out.new_token_ids)
        if s.detok.stopped and not out.finished:
            self.engine.abort_request(out.request_id, FinishReason.STOP)
            s.finish_reason = FinishReason.STOP.value
        elif out.finished:
            delta += s.detok.finish()
            s.finish_reason = out.finish_reason.value if out.finish_reason else "stop"
        if s.detok.stopped:
            s.finish_reason = FinishReason.STOP.value
        if delta and on_text is not None:
            on_text(s.index, delta)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(x, int) for x in items):
        return [[int(x) for x in items]]  # type: ignore[arg-type]
    return [p if isinstance(p, str) else list(p) for p in items]  # type: ignore[arg-type]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
