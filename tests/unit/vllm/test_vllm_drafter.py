"""Speculative decoding on one side only: the lease, layout and compat cover the target
model's KV layers (kvrelay/vllm/drafter.py), without vLLM. Layer names as vLLM 0.32
gives them: EAGLE/EAGLE-3/MTP number the drafter's layers from the target's count on
(llama_eagle.py ``start_layer_id=target_layer_num``, deepseek_mtp.py
``mtp_start_layer_idx``), a draft model prefixes ``draft_model`` (draft_model.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvrelay.relay.geometry import KvGeometry
from kvrelay.relay.transports.layout import layer_cache
from kvrelay.testing.kv import move_over_tcp
from kvrelay.vllm.drafter import Drafter, drafter_of, is_drafter_layer, target_layers

TARGET, BLOCKS, HEADS, BS, C = 3, 8, 2, 4, 16


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def cache(names: list[str], fill: bool = False) -> dict[str, torch.Tensor]:
    """Per-layer views of one storage, in ``names``' order, as vLLM's CPU cache is."""
    storage = (torch.randn if fill else torch.zeros)(len(names), BLOCKS, HEADS, BS, C)
    return {n: storage[i] for i, n in enumerate(names)}


def compat(kv: dict[str, torch.Tensor]) -> str:
    """The connector's compat (register_kv_caches) of what it would describe."""
    layout = layer_cache(kv).layout
    return KvGeometry(architecture="LlamaForCausalLM", num_layers=layout.layers,
                      num_kv_heads=HEADS, head_dim=C // 2, block_size=BS, dtype="float32",
                      layout=layout.name).compat_hash("vllm:smol")


def config(method: str | None, draft_kv: bool | None = None) -> Any:
    """A VllmConfig's speculative and model configs; ``draft_kv`` None: a vLLM without
    ``uses_draft_kv_cache`` (the method list decides)."""
    model = SimpleNamespace(get_total_num_hidden_layers=lambda: TARGET)
    if method is None:
        return SimpleNamespace(speculative_config=None, model_config=model)
    spec = SimpleNamespace(method=method)
    if draft_kv is not None:
        spec.uses_draft_kv_cache = lambda: draft_kv
    return SimpleNamespace(speculative_config=spec, model_config=model)


P_NAMES = [attn(i) for i in range(TARGET)]


@pytest.mark.parametrize(("method", "draft_kv", "has_drafter"), [
    (None, None, False), ("ngram", False, False), ("suffix", False, False),
    ("eagle", True, True), ("mtp", True, True), ("draft_model", True, True),
    ("medusa", None, False), ("suffix", None, False), ("eagle3", None, True),
])
def test_only_methods_with_kv_layers_have_a_drafter(method: str | None, draft_kv: bool | None,
                                                    has_drafter: bool) -> None:
    drafter = drafter_of(config(method, draft_kv))
    assert (drafter is not None) == has_drafter
    if drafter is not None:
        assert drafter == Drafter(str(method), TARGET)


def test_without_a_drafter_every_layer_is_kept_and_the_compat_is_unchanged() -> None:
    kv = cache(P_NAMES)
    before = compat(kv)
    assert target_layers(kv, drafter_of(config(None))) == kv
    assert target_layers(kv, drafter_of(config("ngram", False))) == kv
    assert compat(target_layers(kv, None)) == before


@pytest.mark.parametrize("drafter_names", [
    [attn(TARGET)],  # EAGLE, one layer after the target's
    [attn(TARGET), attn(TARGET + 1)],  # multi-layer EAGLE-3 / DFlash
    [f"model.layers.{TARGET}.mtp_block.self_attn.attn"],  # DeepSeek MTP
    ["draft_model.model.layers.0.self_attn.attn", "draft_model.model.layers.1.self_attn.attn"],
])
def test_p_without_and_d_with_a_drafter_agree(drafter_names: list[str]) -> None:
    d_kv = cache(P_NAMES + drafter_names)
    kept = target_layers(d_kv, Drafter("eagle", TARGET))
    assert list(kept) == P_NAMES
    assert compat(kept) == compat(cache(P_NAMES))
    assert compat(d_kv) != compat(cache(P_NAMES))  # what every pull met before


def test_a_drafter_interleaved_in_the_cache_is_left_out() -> None:
    names = [attn(0), attn(TARGET), attn(1), attn(2)]
    kept = target_layers(cache(names), Drafter("eagle", TARGET))
    assert list(kept) == P_NAMES
    assert layer_cache(kept).layout.layers == TARGET


def test_a_drafter_of_another_shape_does_not_stop_the_description() -> None:
    """A draft model with other heads: its views differ from the target's, which the
    layout refuses for layers it must move, never for layers it leaves alone."""
    d_kv = cache(P_NAMES)
    d_kv["draft_model.model.layers.0.self_attn.attn"] = torch.zeros(BLOCKS, 1, BS, C)
    with pytest.raises(ValueError, match="differs from layer"):
        layer_cache(d_kv)
    kept = target_layers(d_kv, Drafter("draft_model", TARGET))
    assert compat(kept) == compat(cache(P_NAMES))


def test_pulled_blocks_fill_the_target_layers_and_leave_the_drafters_alone() -> None:
    p_kv = cache(P_NAMES, fill=True)
    d_kv = cache([*P_NAMES, attn(TARGET)])
    d_kv[attn(TARGET)].fill_(7.0)  # a reused block's drafter KV
    p, d = layer_cache(p_kv), layer_cache(target_layers(d_kv, Drafter("eagle", TARGET)))
    move_over_tcp(p, d, remote=[5, 2], local=[1, 6])
    for name in P_NAMES:
        assert torch.equal(d_kv[name][[1, 6]], p_kv[name][[5, 2]])
        assert not d_kv[name][[0, 2, 3, 4, 5, 7]].any()
    assert (d_kv[attn(TARGET)] == 7.0).all()


@pytest.mark.parametrize("name", ["drafter.fc_attn", "model.layers.1.self_attn.attn.extra"])
def test_drafter_layers_it_cannot_tell_apart_are_refused_naming_the_method(name: str) -> None:
    kv = cache([*P_NAMES, name])
    with pytest.raises(ValueError, match=r"speculative decoding method 'dflash'.*4 KV layers"):
        target_layers(kv, Drafter("dflash", TARGET))


def test_layer_numbers_past_the_targets_are_the_drafters() -> None:
    assert not is_drafter_layer("model.layers.2.self_attn.attn", 3)
    assert is_drafter_layer("model.layers.3.self_attn.attn", 3)
    assert is_drafter_layer("layers.12.attn", 3)
    assert not is_drafter_layer("model.layers.12", 30)
    assert is_drafter_layer("draft_model.model.layers.0.self_attn.attn", 30)
    assert not is_drafter_layer("model.mylayers.40.attn", 30)
