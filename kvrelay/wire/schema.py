"""A request's JSON Schema (response_format, a forced tool call) compiled to the
llguidance grammar text that SamplingParams carries, on the request side (any thread),
so the engine thread never meets a bad schema: errors name ``response_format``. The
engine side (the token masks) is kvrelay.model.sampling.grammar."""

from __future__ import annotations

import functools

import llguidance as llg

from kvrelay.sampling_params import InvalidParameter, StructuredOutput


def structured_output(kind: str, schema: str) -> StructuredOutput:
    """The spec SamplingParams carries: ``kind`` (json_object, json_schema) and the JSON
    Schema as text, compiled here, so the engine thread never meets a bad schema; the
    error names ``response_format``."""
    if kind not in ("json_object", "json_schema"):
        raise InvalidParameter("response_format", "response_format type must be "
                               f"json_object or json_schema, got {kind!r}")
    return StructuredOutput(kind, schema, compile_grammar(schema))



@functools.lru_cache(maxsize=256)
def compile_grammar(schema: str) -> str:
    """The llguidance grammar of a JSON Schema given as text (recent ones cached: a
    schema is usually sent again and again); the error names ``response_format``."""
    try:
        # Compact JSON (no free whitespace): a small model cannot stall in endless newlines.
        grammar = llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
    except ValueError as exc:
        raise InvalidParameter("response_format", f"the JSON schema is not valid: {exc}") from exc
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:
        # Warnings are unsupported or invalid keywords: refusing beats silently
        # generating JSON that ignores part of the schema.
        raise InvalidParameter(
            "response_format", f"the JSON schema cannot be enforced: {'; '.join(messages)}"
        )
    return grammar
