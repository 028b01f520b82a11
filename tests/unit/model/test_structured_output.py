"""Structured output and logit_bias in the sampler, on a real (tiny, random) model."""

from __future__ import annotations

import json

import pytest

import kvrelay
from kvrelay.core.runner import ScheduledRequest
from kvrelay.model.sampling.grammar import GrammarMasks, GrammarTokenizer
from kvrelay.sampling_params import InvalidParameter, SamplingParams
from kvrelay.testing.models import write_tiny_hf_model
from kvrelay.wire.schema import structured_output

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "ok", "n", "tags"],
    "additionalProperties": False,
}
SPEC = structured_output("json_schema", json.dumps(SCHEMA))


def _matches_schema(doc: object) -> bool:
    return (
        isinstance(doc, dict) and list(doc) == ["name", "ok", "n", "tags"]  # schema order
        and isinstance(doc["name"], str) and len(doc["name"]) <= 5
        and isinstance(doc["ok"], bool)
        and isinstance(doc["n"], int) and not isinstance(doc["n"], bool) and 0 <= doc["n"] <= 99
        and isinstance(doc["tags"], list) and len(doc["tags"]) <= 2
        and all(t in ("a", "b") for t in doc["tags"])
    )


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> kvrelay.LLM:
    path = write_tiny_hf_model(tmp_path_factory.mktemp("so") / "llama", seed=3)
    return kvrelay.LLM(str(path), block_size=4, num_blocks=512, max_num_batched_tokens=64)


def test_schema_output_parses_and_matches_batched_with_free_requests(llm: kvrelay.LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (alone,) = llm.generate("Hello world", free)
    prompts = ["Hello world", "What is the capital", "Once upon a time", "Hello world"]
    params = [
        free,
        SamplingParams(temperature=1.0, seed=7, max_tokens=80, structured=SPEC),
        SamplingParams(temperature=0.0, max_tokens=80, structured=SPEC),
        SamplingParams(temperature=0.9, seed=3, max_tokens=80, structured=SPEC),
    ]
    outs = llm.generate(prompts, params)
    # The unconstrained row of the batch is untouched by its neighbours' masks.
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    for out in outs[1:]:
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        assert _matches_schema(json.loads(o.text)), o.text
    assert llm.engine.pool.num_in_use == 0


def test_logit_bias_forces_and_forbids(llm: kvrelay.LLM) -> None:
    tok = llm.tokenizer.encode("fox", add_special_tokens=False)[0]
    forced = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                            logit_bias=((tok, 100.0),))
    (out,) = llm.generate("Hello", forced)
    assert out.outputs[0].token_ids == [tok] * 4
    free = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    (first,) = llm.generate("Hello", free)
    banned = first.outputs[0].token_ids[0]
    (other,) = llm.generate("Hello", SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, logit_bias={banned: -100.0}))
    assert other.outputs[0].token_ids[0] != banned


@pytest.mark.parametrize("schema, fragment", [
    ("{not json", "not valid"),
    (json.dumps({"type": "objectx"}), "cannot be enforced"),
    (json.dumps({"$ref": "#/nowhere"}), "cannot be enforced"),
])
def test_bad_schema_names_response_format(schema: str, fragment: str) -> None:
    with pytest.raises(InvalidParameter, match=fragment) as info:
        structured_output("json_schema", schema)
    assert info.value.param == "response_format"


def test_tokens_reach_the_grammar_once_whatever_the_chunking(llm: kvrelay.LLM) -> None:
    """A first token sampled elsewhere (a prefill engine) or a recomputed chunk after
    preemption feeds the grammar like a token sampled here, and only once."""
    tok = llm.tokenizer
    gt = GrammarTokenizer(tok.tok.to_str, llm.model.config.vocab_size,  # type: ignore[attr-defined]
                          tok.eos_token_ids)
    masks = GrammarMasks(gt)
    doc = tok.encode('{"name":"ab"', add_special_tokens=False)
    params = SamplingParams(structured=SPEC)
    prompt = [5, 6, 7]

    def chunk(start: int, ids: list[int]) -> ScheduledRequest:
        return ScheduledRequest("r", ids, start, [], True, params, len(prompt))

    masks.observe([chunk(0, prompt + doc[:1])], lambda sr: sr.token_ids)  # P's first token
    masks.observe([chunk(3, doc[:1])], lambda sr: sr.token_ids)  # seen already: ignored
    masks.observe([chunk(0, prompt + doc)], lambda sr: sr.token_ids)  # recompute, overlap
    state = masks._states["r"]
    assert not state.matcher.is_error() and state.next_pos == len(prompt) + len(doc)
    # What the grammar now allows is a continuation of the object, never a second '{'.
    import torch

    logits = torch.zeros(1, llm.model.config.vocab_size)
    masks.apply(logits, [0], ["r"])
    brace = tok.encode("{", add_special_tokens=False)[0]
    comma = tok.encode(",", add_special_tokens=False)[0]
    assert logits[0, brace] == float("-inf") and logits[0, comma] == 0.0


def test_bench_grammar_prints_a_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    from kvrelay.cli import main

    assert main(["bench", "grammar", "--batch", "4", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "llguidance" in out and "constrained/unconstrained sampling time ratio:" in out
