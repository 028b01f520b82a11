"""Command-line conventions shared by every command: defaults in --help, one exit
code per kind of mistake, one-line errors, --dtype auto, demo --server-arg."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from kvrelay.cli import build_parser, main
from kvrelay.demo import server_args
from kvrelay.errors import EXIT_USAGE, UsageError
from kvrelay.model import loader
from kvrelay.model.kernels import cpu
from kvrelay.testing.models import write_tiny_hf_model


def _parsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [p]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out += _parsers(sub)
    return out


def test_help_shows_every_default_and_never_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_API_KEY", "s3cret-key")
    monkeypatch.setenv("KVRELAY_RELAY_SECRET", "s3cret-relay")
    for p in _parsers(build_parser()):
        text = " ".join(p.format_help().split())
        assert "s3cret" not in text, p.prog
        for a in p._actions:
            if not a.option_strings or a.default in (None, False, argparse.SUPPRESS):
                continue
            if "key" in a.dest or "secret" in a.dest or a.dest == "help":
                continue
            # The option's own help line names its default.
            assert "default" in (a.help or "").lower() or f"default: {a.default}" in text, (
                p.prog, a.dest)


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "/no/such/model.gguf", "hi"],
    ["serve", "/no/such/model.gguf", "--port", "1"],
    ["bench", "offline", "--model", "/no/such/model.gguf", "--skip-transformers"],
    ["demo", "--model", "/no/such/model.gguf"],
])
def test_a_missing_model_is_exit_2_everywhere(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err


def test_bench_offline_without_transformers_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *a: Any) -> Any:
        return None if name == "transformers" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert main(["bench", "offline", "--num-prompts", "1"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("kvrelay bench offline: ") and "--skip-transformers" in err
    assert "Traceback" not in err


def test_demo_server_arg_takes_a_shell_line() -> None:
    assert server_args(None, ["--dtype bfloat16", "--max-num-seqs=8"]) == [
        "--dtype", "bfloat16", "--max-num-seqs=8"]
    with pytest.raises(UsageError, match="no argument '--bogus'"):
        server_args(None, ["--bogus 1"])
    with pytest.raises(UsageError, match="invalid choice"):
        server_args(None, ["--dtype float64"])


def test_dtype_auto_follows_the_cpu_whatever_the_checkpoint_stores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU: bfloat16 where it computes bf16 natively, else float32, for float32,
    bfloat16, float16 and GGUF checkpoints alike (no default is the slow bf16 path of
    an AVX2-only CPU)."""
    d = write_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}
    for native, want in [(True, "bfloat16"), (False, "float32")]:
        monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda n=native: n)
        for stored in ("bfloat16", "float16", "float32", "int8"):
            (d / "config.json").write_text(json.dumps({**cfg, "torch_dtype": stored}))
            assert loader.auto_dtype(d) == want, (native, stored)
        assert loader.auto_dtype(tmp_path / "x.gguf") == want
        (d / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
        m = loader.load_model(str(d), dtype="auto", num_blocks=8, block_size=4)
        assert m.kv_geometry.dtype == want


def test_dtype_auto_is_the_default_of_every_entry_point() -> None:
    import inspect

    from kvrelay import LLM

    assert inspect.signature(LLM).parameters["dtype"].default == "auto"
    parser = build_parser()
    for argv in (["serve"], ["generate", "hi"], ["bench", "offline"], ["bench", "prefix"],
                 ["bench", "routing"]):
        assert parser.parse_args(argv).dtype == "auto", argv
    assert parser.parse_args(["bench", "serve"]).offline_dtype == "auto"


def test_cpu_bf16_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for flags, want in [("fpu avx2 fma", False), ("avx2 avx512f avx512_bf16", True),
                        ("avx512f amx_bf16 amx_tile", True), ("avx512f avx512bw", False)]:
        info = tmp_path / f"cpuinfo-{want}-{len(flags)}"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(cpu, "CPUINFO", info)
        assert cpu.cpu_has_native_bf16() is want, flags


def test_bfloat16_is_refused_on_a_cpu_without_native_bf16(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--dtype bfloat16 where the CPU flags lack avx512_bf16 / amx_bf16 / bf16 (faked
    through /proc/cpuinfo): a clear error naming the flags and the choices, from
    load_model and from the CLI (exit 2, one line); KVRELAY_ALLOW_SLOW_BF16=1 lets it
    run, and a CPU with the flags runs it without the override."""
    from kvrelay.cli import main
    from kvrelay.model.config import RefusedChoice

    d = write_tiny_hf_model(tmp_path / "m")
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu, "CPUINFO", info)
    monkeypatch.delenv(loader.ALLOW_SLOW_BF16, raising=False)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512bw\n")
    with pytest.raises(RefusedChoice, match=r"avx512_bf16.*--dtype float32 or --dtype auto"):
        loader.load_model(str(d), dtype="bfloat16", num_blocks=8, block_size=4)
    assert main(["generate", "--model", str(d), "--dtype", "bfloat16", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no native bfloat16" in err and "KVRELAY_ALLOW_SLOW_BF16=1" in err
    assert "Traceback" not in err
    m = loader.load_model(str(d), dtype="auto", num_blocks=8, block_size=4)
    assert m.kv_geometry.dtype == "float32"
    monkeypatch.setenv(loader.ALLOW_SLOW_BF16, "1")
    m = loader.load_model(str(d), dtype="bfloat16", num_blocks=8, block_size=4)
    assert m.kv_geometry.dtype == "bfloat16"
    monkeypatch.delenv(loader.ALLOW_SLOW_BF16)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n")
    m = loader.load_model(str(d), dtype="bfloat16", num_blocks=8, block_size=4)
    assert m.kv_geometry.dtype == "bfloat16"
