"""The tools of the tool-calling e2e tests (chat and Responses API): two schemas that bound
every string and number, so a tiny random model's call ends within max_tokens; the check
of a call's arguments; and the tiny model with room for the tools' description."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}


def valid_args(name: str, arguments: str) -> bool:
    """Whether ``arguments`` (JSON text) are what ``name``'s schema allows."""
    doc = json.loads(arguments)
    if name == "get_time":
        return doc in ({"zone": "UTC"}, {"zone": "CET"})
    return (isinstance(doc, dict) and list(doc) == ["city", "days"]
            and isinstance(doc["city"], str) and len(doc["city"]) <= 6
            and type(doc["days"]) is int and 1 <= doc["days"] <= 7)


def roomy_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random HF model with a 2,048-token context: the tools' description (a
    system message when the template ignores tools) is long for its character-level
    vocabulary."""
    from kvrelay.testing.models import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=2048)))
    return model
