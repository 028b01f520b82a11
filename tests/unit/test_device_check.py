"""scripts/device-check.sh stays runnable off a GPU: shell syntax, every kvrelay module
imports, and the checkpoints it writes load through the real loader. The whole dry run
(`scripts/device-check.sh --device cpu`, ~20 s: servers, 1P1D, bench) is not part of
the suite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "scripts" / "device_check.py"


def test_script_is_valid_bash() -> None:
    for script in ("device-check.sh", "device-wheels.sh"):
        subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)


def test_every_module_imports() -> None:
    out = subprocess.run([sys.executable, str(HELPER), "imports"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["import_failures"] == []


def test_small_checkpoints_load_with_the_shapes_asked(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(HELPER), "models", str(tmp_path), "--small"],
                   check=True, capture_output=True, timeout=120)
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import device_check
    finally:
        sys.path.pop(0)
    from kvrelay.model import load_model

    for name, real in (("smollm2-135m", "smollm2-135m"), ("llama-1b", "llama-1b"),
                       ("smollm2-pd", "smollm2-135m")):
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        assert cfg["num_hidden_layers"] == device_check.SMALL["num_hidden_layers"]
        # Shape fields the small mode does not scale are the real model's.
        assert cfg["rope_theta"] == device_check.SHAPES[real]["rope_theta"]
    m = load_model(str(tmp_path / "smollm2-pd"), dtype="float32", device="cpu", num_blocks=8)
    assert m.kv_geometry.num_layers == device_check.SMALL["num_hidden_layers"]


def test_the_connector_step_dry_run_moves_every_byte() -> None:
    """The device check's connector step (kvrelay.bench.connector_kv) on CPU tensors:
    the staged tcp leg (and nixl, DRAM here, where installed) checked byte for byte;
    cuda_ipc needs CUDA."""
    out = subprocess.run([sys.executable, "-m", "kvrelay.bench.connector_kv", "--device",
                          "cpu", "--reps", "1"], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {ln.split()[0]: ln for ln in out.stdout.splitlines()[2:]}
    assert rows["d2d"].endswith(" ok") and rows["tcp_staged"].endswith(" ok")
    assert "skipped: needs CUDA" in rows["cuda_ipc"]
