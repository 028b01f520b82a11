"""Chat templates render exactly as transformers' ``apply_chat_template`` renders them.

Real templates (tests/data/chat_templates, each naming its origin; SmolLM2's from the
embedded model) with system, developer, multi-turn and tool messages, rendered by
kvrelay's ``Tokenizer`` and by transformers on the same tokenizer.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer as HfTokenizer

from kvrelay.model.formats.gguf_file import GgufFile
from kvrelay.model.loader import default_model_path
from kvrelay.model.text.tokenizer import ChatTemplateError, Tokenizer
from kvrelay.testing.models import tiny_tokenizer_json

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parents[2] / "data" / "chat_templates"
BOS, EOS = "<|endoftext|>", "<|im_end|>"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo d'une ville <b>& ses environs</b>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "ville, ex. « Zürich »"}},
            "required": ["city"],
        },
    },
}
TOOL_CALL = {"id": "call12345", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}

CHATS: dict[str, list[dict[str, Any]]] = {
    "system": [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "Hi <there> & ünïcödé"}],
    "developer": [{"role": "developer", "content": "Answer in French."},
                  {"role": "user", "content": "Hello"}],
    "multi_turn": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                   {"role": "user", "content": "and 2+2?"}],
    "not_alternating": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    "tools": [{"role": "user", "content": "Weather in Zürich?"},
              {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
              {"role": "tool", "content": "{\"temp\": 3}", "tool_call_id": "call12345",
               "name": "get_weather"}],
}


def _tokenizer(template: str) -> Tokenizer:
    return Tokenizer(HfTokenizer.from_str(tiny_tokenizer_json()), vocab_size=64,
                     chat_template=template, bos_token=BOS, eos_token=EOS)


def _transformers_render(template: str, chat: list[dict[str, Any]], tools: Any) -> str:
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=HfTokenizer.from_str(tiny_tokenizer_json()), bos_token=BOS,
        eos_token=EOS,
    )
    # transformers has no developer role: what vLLM and OpenAI do is render it as system.
    chat = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in chat]
    return str(hf.apply_chat_template(chat, tools=tools, chat_template=template,
                                      tokenize=False, add_generation_prompt=True))


def _templates() -> dict[str, str]:
    out = {p.stem: p.read_text() for p in sorted(TEMPLATES.glob("*.jinja"))}
    meta = GgufFile(default_model_path()).fields
    out["smollm2"] = str(meta["tokenizer.chat_template"])
    return out


TEMPLATE_TEXTS = _templates()


@pytest.mark.parametrize("chat_name", sorted(CHATS))
@pytest.mark.parametrize("template_name", sorted(TEMPLATE_TEXTS))
def test_render_matches_transformers(template_name: str, chat_name: str) -> None:
    template = TEMPLATE_TEXTS[template_name]
    chat = CHATS[chat_name]
    tools = [WEATHER_TOOL] if chat_name == "tools" else None
    try:
        expected = _transformers_render(template, copy.deepcopy(chat), tools)
    except jinja2.TemplateError as exc:  # the template refuses this conversation
        with pytest.raises(ChatTemplateError, match=str(exc)[:40]):
            _tokenizer(template).apply_chat_template(copy.deepcopy(chat), tools=tools)
        return
    got = _tokenizer(template).apply_chat_template(copy.deepcopy(chat), tools=tools)
    assert got == expected
    if tools is not None and "tojson" in template and "Zürich" in got:
        assert "Zürich" in got and "<b>" in got  # tojson escapes neither non-ASCII nor HTML


def test_every_template_was_exercised_with_tools() -> None:
    # The corpus is meant to cover tool rendering: at least three templates use tools.
    assert sum("tools" in t for t in TEMPLATE_TEXTS.values()) >= 3


def test_loop_controls_strftime_and_raise() -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }}|{% if loop.index >= 2 %}{% break %}{% endif %}{% endfor %}"
        "{{ strftime_now('%Y') }}{{ {'k': 'é<'} | tojson(indent=1) }}"
    )
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    got = _tokenizer(template).apply_chat_template(chat)
    assert got == _transformers_render(template, chat, None)
    year = transformers.utils.chat_template_utils.datetime.now().strftime("%Y")
    assert got == 'a|' + year + '{\n "k": "é<"\n}'  # the system turn skipped, then a break
    with pytest.raises(ChatTemplateError, match="no such turn"):
        _tokenizer("{{ raise_exception('no such turn') }}").apply_chat_template(chat)


def test_developer_role_kept_when_the_template_knows_it() -> None:
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{# developer #}"
    got = _tokenizer(template).apply_chat_template(CHATS["developer"])
    assert got.startswith("[developer]Answer in French.")
    plain = template.replace("{# developer #}", "")
    assert _tokenizer(plain).apply_chat_template(CHATS["developer"]).startswith("[system]")
