"""`kvrelay generate` on a tiny model."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvrelay.model import cli
from kvrelay.testing.models import write_tiny_hf_model


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["generate", *argv])
    return int(args.func(args))


def test_generate_prints_the_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_tiny_hf_model(tmp_path / "m")
    assert _run(["--model", str(path), "--chat", "--max-tokens", "5", "Hello"]) == 0
    chat = capsys.readouterr().out
    assert _run(["--model", str(path), "--max-tokens", "5", "Hello"]) == 0
    plain = capsys.readouterr().out
    assert chat.endswith("\n") and plain.endswith("\n") and chat != plain


def test_bad_input_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--model", str(tmp_path / "missing.gguf"), "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert _run(["--temperature", "5", "x"]) == 2
    assert "--temperature" in capsys.readouterr().err
