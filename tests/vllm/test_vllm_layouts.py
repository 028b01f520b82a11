"""The KV layouts vLLM builds, as vLLM builds them, moved byte for byte by kvrelay's
transports (tests/vllm/layouts_probe.py, in the vLLM 0.32 venv): CPU (LBHNC),
FlashAttention (vLLM's default LBNHC, and LBHNC as the connector asks), FlashInfer
(LBNHC; LBHNC and BLHNC on SM100), FlashMLA with 64-token kernel blocks under
128-token manager blocks, and the remaining stride orders.

What the probe cannot import on CPU (FlashInfer) is copied into it; the vLLM 0.34
sources it stands for, and the 0.34 code that plans and views the cache (identical to
0.32's where the probe runs it), are pinned by the hash of their source text: a change
there fails here, to be read and the copy or the description brought up to date."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.vllm.pair import PYTHON, REPO, VENV

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def probe() -> dict:
    if not PYTHON.exists():
        pytest.skip(f"no vLLM venv at {VENV} (set KVRELAY_VLLM_VENV)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([str(PYTHON), "-m", "tests.vllm.layouts_probe"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no summary (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result: dict = json.loads(lines[-1])
    return result


def test_every_layout_vllm_builds_moves_byte_for_byte(probe: dict) -> None:
    assert not probe["failed"], probe["failed"]
    cases = {c["case"]: c for c in probe["cases"]}
    assert len(cases) == 11
    for c in cases.values():
        assert c["moved"]["tcp"] >= 10 and c["moved"]["tcp_staged"] >= 10, c


def test_what_vllm_lays_out_and_what_kvrelay_names_it(probe: dict) -> None:
    assert probe["cpu_layouts"] == ["LBHNC"]
    assert probe["flash_attn_declares"] is None  # so vLLM's default, or the connector's
    assert probe["flashmla_kernel_sizes"] == [64]
    assert probe["connector_asks"] == {"full": "LBHNC", "mla": None}
    cases = {c["case"]: c for c in probe["cases"]}
    cpu = cases["CPU_ATTN"]
    assert cpu["contiguous"] and cpu["name"] == "regions:3x16384"  # 4 x 32 x 64 x 2 B
    fa = cases["FLASH_ATTN default"]
    assert fa["vllm_layout"] == "LBNHC" and not fa["contiguous"]
    assert fa["order"] == "LBNHC" and fa["ranges_per_run"] == 3  # a page per layer
    assert cases["FLASH_ATTN with kvrelay's LBHNC"]["order"] == "LBHNC"
    sm100 = cases["FLASHINFER SM100 BLHNC"]
    assert sm100["order"] == "BLHNC" and sm100["ranges_per_run"] == 1
    mla = cases["FLASHMLA block 128"]
    assert (mla["kernel_block"], mla["shape"][0]) == (64, 24)  # dim 0: 12 blocks x 2
    assert mla["order"] == "LBKNC" and ":L3,K2,H1,N64,C576x2B:FLASHMLA" in mla["name"]
    assert cases["any LHBNC"]["ranges_per_run"] == 3 * 4  # heads outside blocks


VLLM34 = [Path(os.environ["KVRELAY_VLLM34_VENV"])] if os.environ.get(
    "KVRELAY_VLLM34_VENV") else [Path("/tmp/kvrelay-vllm/v-vllm34")]
# vLLM 0.34.0 sources: (file, qualified name) -> sha256 of the source text (first 16).
PINNED_34 = {
    ("v1/attention/backends/flashinfer.py", "FlashInferBackend.supported_kv_cache_layouts"):
        "5f76e2f46ede5355",  # :731, copied into the probe
    ("v1/attention/backends/utils.py", "get_flashinfer_kv_cache_layouts"): "98d1c3b4fd2579ba",
    ("v1/attention/backends/utils.py", "_DEFAULT_LAYOUT_PREFERENCE"): "50b499f1937f5663",
    ("v1/attention/backends/utils.py", "get_supported_kv_cache_layouts"): "a38ad69ef1b7544b",
    ("v1/kv_cache_interface.py", "create_kv_cache_views"): "91be24c74d7f448d",
    ("v1/kv_cache_interface.py", "compute_layout_strides"): "7476d5cab1a60a5d",
    ("v1/kv_cache_interface.py", "compute_layer_kv_cache_shape_bytes"): "8ed36186d19bfcb7",
    ("v1/kv_cache_interface.py", "group_kernel_blocks"): "71617011d198733e",
    ("v1/kv_cache_layout.py", "KVCacheLayout"): "25bd348fd746932f",
    ("v1/worker/utils.py", "allocate_kv_cache"): "c125429c82783bee",
    ("v1/core/kv_cache_planning.py", "get_kv_cache_config_from_groups"): "4b72ed9c142f70dd",
    ("v1/attention/backends/mla/flashmla.py",
     "FlashMLABackend.get_supported_kernel_block_sizes"): "c54af4d7f6d61f6b",
    ("v1/attention/backends/cpu_attn.py", "CPUAttentionBackend.supported_kv_cache_layouts"):
        "911097ce99d7a1bd",
}
PINNED_32 = {
    ("v1/attention/backends/flashinfer.py", "FlashInferBackend.supported_kv_cache_layouts"):
        "928ad08f2236c8f7",  # :604-610, copied into the probe
}


def source_hash(path: Path, qual: str) -> str:
    text = path.read_text()
    nodes: list[ast.stmt] = ast.parse(text).body
    node: ast.stmt | None = None
    for part in qual.split("."):
        node = next(n for n in nodes if getattr(n, "name", None) == part or (
            isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == part))
        nodes = getattr(node, "body", [])
    assert node is not None
    return hashlib.sha256((ast.get_source_segment(text, node) or "").encode()).hexdigest()[:16]


def vllm_sources(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/python3*/site-packages/vllm"))
    return found[0] if found else None


@pytest.mark.parametrize(("version", "pins"), [("0.32", PINNED_32), ("0.34", PINNED_34)])
def test_the_vllm_code_the_layouts_come_from_is_unchanged(version: str, pins: dict) -> None:
    venv = VENV if version == "0.32" else VLLM34[0]
    src = vllm_sources(venv)
    if src is None:
        pytest.skip(f"no vLLM {version} sources under {venv}")
    changed = {f"{f}:{q}" for (f, q), h in pins.items() if source_hash(src / f, q) != h}
    assert not changed, (f"vLLM {version} changed {sorted(changed)}: read them and bring "
                         "layouts_probe.py and transports/layout.py up to date")
