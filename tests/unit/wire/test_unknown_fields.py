"""Fields a request model lacks are dropped with one warning per field name, not one
per request: routers such as vllm-router add their own fields to every request."""

from __future__ import annotations

import logging

import pytest

from kvrelay.wire import http
from kvrelay.wire.openai import CompletionRequest


def test_an_unknown_field_is_warned_about_once_per_name(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "_WARNED", set())
    body = {"model": "m", "prompt": "x", "no_stop_trim": False, "return_hidden_states": False}
    with caplog.at_level(logging.DEBUG, logger=http.log.name):
        for _ in range(5):
            req = http.validate(dict(body), CompletionRequest)
            assert req.prompt == "x"
        http.validate({**body, "separate_reasoning": True}, CompletionRequest)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "the request's fields ['no_stop_trim', 'return_hidden_states'] are not known here: "
        "ignored (said once per name)",
        "the request's fields ['separate_reasoning'] are not known here: ignored (said once "
        "per name)",
    ]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 4


def test_the_names_remembered_are_bounded(caplog: pytest.LogCaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends a new name each time sizes nothing: past the cap, DEBUG."""
    monkeypatch.setattr(http, "_WARNED", set())
    monkeypatch.setattr(http, "WARNED_NAMES_MAX", 3)
    with caplog.at_level(logging.WARNING, logger=http.log.name):
        for i in range(10):
            http.validate({"model": "m", "prompt": "x", f"field_{i}": 1}, CompletionRequest)
    assert len(http._WARNED) == 3
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 3
