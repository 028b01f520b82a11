"""response_format, logit_bias and the refused fields through the openai client, on
a colocated ``kvrelay serve`` and on 1P1D behind the proxy (real processes, tiny model).

The schema bounds every string and number so a random tiny model finishes its object
within max_tokens; the output must parse as JSON and match the schema. Seeded sampling
gives the same JSON colocated and disaggregated: the prefill engine's first token
reaches the decode engine's grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer as HfTokenizer

from tests.e2e.cluster import Proc, colocated_and_pd

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SCHEMA = {
    "type": "object",
    "properties": {  # not in alphabetical order: the output keeps this order
        "temp": {"type": "integer", "minimum": -20, "maximum": 45},
        "city": {"type": "string", "maxLength": 6},
        "sunny": {"type": "boolean"},
    },
    "required": ["temp", "city", "sunny"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}


def _matches(doc: Any) -> bool:
    return (isinstance(doc, dict) and list(doc) == ["temp", "city", "sunny"]
            and isinstance(doc["city"], str) and len(doc["city"]) <= 6
            and isinstance(doc["sunny"], bool)
            and type(doc["temp"]) is int and -20 <= doc["temp"] <= 45)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvrelay.testing.models import write_tiny_hf_model

    return Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def procs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    with colocated_and_pd(model_dir, tmp_path_factory.mktemp("structured-logs")) as (_, out):
        yield out


def client(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_json_schema_parses_and_matches_colocated_and_1p1d(procs: dict[str, Proc]) -> None:
    answers: dict[str, list[str]] = {}
    for where in ("colo", "proxy"):
        c = client(procs[where])
        model = c.models.list().data[0].id
        texts = []
        for seed in (1, 2):
            r = c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
                temperature=1.0, seed=seed, max_tokens=60,
            )
            texts.append(r.choices[0].message.content or "")
            assert r.choices[0].finish_reason == "stop"
        cr = c.completions.create(model=model, prompt="Weather:", max_tokens=60, temperature=0,
                                  extra_body={"response_format": RESPONSE_FORMAT})
        texts.append(cr.choices[0].text)
        for text in texts:
            assert _matches(json.loads(text)), text
        answers[where] = texts
    assert answers["colo"] == answers["proxy"]


def test_logit_bias_applied(procs: dict[str, Proc], model_dir: Path) -> None:
    tok = HfTokenizer.from_file(str(model_dir / "tokenizer.json"))
    fox = tok.encode("fox", add_special_tokens=False).ids[0]
    c = client(procs["colo"])
    model = c.models.list().data[0].id
    r = c.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                             logit_bias={str(fox): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode([fox]) * 3


@pytest.mark.parametrize("kind, kwargs, param", [
    ("chat", {"tools": [{"type": "fn", "function": {"name": "f", "parameters": {}}}]},
     "tools[0].type"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("completion", {"suffix": "end"}, "suffix"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("completion", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completion", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("completion", {"logit_bias": {"5": 101}}, "logit_bias"),
])
def test_refused_with_400_naming_the_field(
    procs: dict[str, Proc], kind: str, kwargs: dict[str, Any], param: str
) -> None:
    c = client(procs["colo"])
    model = c.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "chat":
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=2, extra_body=kwargs)
        else:
            c.completions.create(model=model, prompt="hi", max_tokens=2, extra_body=kwargs)
    body: Any = info.value.body
    assert body["param"] == param, body
