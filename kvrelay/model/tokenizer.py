"""Tokenizer: a ``tokenizers`` tokenizer plus the chat template and special tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HfTokenizer

# Turn-end markers of common chat formats: generation ends there too, as with eos.
CHAT_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class ChatTemplateError(ValueError):
    pass


class Tokenizer:
    def __init__(
        self,
        tok: HfTokenizer,
        *,
        vocab_size: int,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self.tok = tok
        self.vocab_size = vocab_size
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        eos = [tok.token_to_id(eos_token)] if eos_token else []
        eos += list(extra_eos_ids)
        if chat_template:
            eos += [tok.token_to_id(m) for m in CHAT_END_MARKERS if m in chat_template]
        self.eos_token_ids: Sequence[int] = sorted({i for i in eos if i is not None})
        self._template: jinja2.Template | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _raise(message: str) -> Any:
    raise ChatTemplateError(message)
