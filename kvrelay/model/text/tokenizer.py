"""Tokenizer: a ``tokenizers`` tokenizer plus the chat template and special tokens.

Chat templates are written for transformers' ``apply_chat_template``, so they are
rendered in the same jinja environment: a sandbox with ``trim_blocks`` and
``lstrip_blocks``, loop controls (``{% break %}``, ``{% continue %}``),
``raise_exception``, ``strftime_now``, and a ``tojson`` that neither escapes
non-ASCII nor HTML and takes ``indent``/``separators``/``sort_keys``. The
``{% generation %}`` tag (assistant masks for training) renders its body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
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
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render as transformers does; ``developer`` turns become ``system`` turns
        when the template knows no developer role (as vLLM and OpenAI treat them)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        msgs = [dict(m) for m in messages]
        if "developer" not in self.chat_template:
            for m in msgs:
                if m.get("role") == "developer":
                    m["role"] = "system"
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        context.update(kwargs)
        try:
            return self._template.render(
                messages=msgs,
                tools=None if tools is None else [dict(t) for t in tools],
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}``: renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def compile_chat_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc}") from exc


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _raise(message: str) -> Any:
    raise ChatTemplateError(message)
