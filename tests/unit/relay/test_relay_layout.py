"""Layouts as descriptions (transports/layout.py): per-layer ``[B, H, N, C]`` views in
each of vLLM's stride orders, with kernel-block splits, MLA's single latent head,
padded pages and per-layer allocations, moved P -> D over tcp and nixl and compared
byte for byte (the oracle is torch's own indexing of the views, not the ranges under
test); the names and compat hashes HELLO compares; what is refused, and how.

vLLM's own allocation of these views is checked against the same code in
tests/vllm/test_vllm_layouts.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.relay.client import RelayUnavailable
from kvrelay.relay.geometry import KvGeometry
from kvrelay.relay.transports import nixl
from kvrelay.relay.transports.layout import head_part, layer_cache, named_as
from kvrelay.testing.kv import move_over_nixl, move_over_tcp

# vLLM's KVCacheLayout (vllm/v1/kv_cache_layout.py, identical in 0.32 and 0.34): the
# physical order of the logical [L, B, H, N, C] dims, outermost first.
ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
          "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def views(order: str, layers: int, blocks: int, k: int, heads: int, tokens: int,
          content: int, dtype: torch.dtype, pad: int = 0, apart: bool = False,
          fill: bool = False, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Per-layer views of one buffer in ``order`` (``pad`` spare elements after each
    kernel block, as vLLM pads pages), or of one buffer each (``apart``)."""
    shape = (1 if apart else layers, blocks * k, heads, tokens, content)
    strides = [0] * 5
    cur = 1
    for dim in reversed(ORDERS[order]):
        strides[dim] = cur + (pad if dim == 1 else 0)
        cur = strides[dim] * shape[dim]
    raws = [torch.zeros(cur, dtype=dtype, device=device) for _ in range(layers if apart else 1)]
    if fill:
        for raw in raws:
            raw.view(torch.int16 if dtype != torch.float32 else torch.int32).random_()
    return {f"model.layers.{i}.attn": torch.as_strided(raws[i], shape, strides)[0]
            if apart else torch.as_strided(raws[0], shape, strides)[i] for i in range(layers)}


def block(v: torch.Tensor, b: int, k: int) -> torch.Tensor:
    return v[b * k:(b + 1) * k].view(torch.uint8)


def assert_moved(p: dict[str, torch.Tensor], d: dict[str, torch.Tensor], remote: list[int],
                 local: list[int], k: int) -> None:
    """Every byte of D's ``local[i]`` is P's ``remote[i]``; D holds nothing else."""
    for name in p:
        for r, lb in zip(remote, local, strict=True):
            assert torch.equal(block(d[name], lb, k), block(p[name], r, k)), (name, r, lb)
    for name in d:
        for lb in local:
            d[name][lb * k:(lb + 1) * k].zero_()
    for v in d.values():
        assert not v.view(torch.uint8).any(), "bytes outside the blocks read were written"


@st.composite
def cases(draw: st.DrawFn) -> dict:
    order = draw(st.sampled_from(sorted(ORDERS)))
    mla = draw(st.booleans())
    c = dict(order=order, layers=draw(st.integers(1, 3)), k=draw(st.sampled_from([1, 2, 4])),
             heads=1 if mla else draw(st.integers(1, 3)), tokens=draw(st.sampled_from([1, 2, 4])),
             content=draw(st.sampled_from([1, 3, 8])), dtype=draw(st.sampled_from(DTYPES)),
             pad=draw(st.sampled_from([0, 0, 2])), apart=draw(st.booleans()) and order[0] == "L")
    p_blocks, d_blocks = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    n = draw(st.integers(0, min(p_blocks, d_blocks)))
    c["remote"] = draw(st.permutations(range(p_blocks)))[:n]
    local = list(range(d_blocks)) if draw(st.booleans()) else draw(
        st.permutations(range(d_blocks)))
    c["local"] = local[:n]
    c["blocks"] = (p_blocks, d_blocks)
    return c


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_any_stride_order_moves_byte_for_byte_over_tcp(c: dict) -> None:
    shape = {x: c[x] for x in ("order", "layers", "k", "heads", "tokens", "content",
                               "dtype", "pad", "apart")}
    p = views(blocks=c["blocks"][0], fill=True, **shape)
    d = views(blocks=c["blocks"][1], **shape)
    pc, dc = layer_cache(p, c["blocks"][0]), layer_cache(d, c["blocks"][1])
    assert pc.layout.name == dc.layout.name  # what HELLO compares
    move_over_tcp(pc, dc, c["remote"], c["local"])
    assert_moved(p, d, c["remote"], c["local"], c["k"])


NIXL_CASES = [("LBHNC", 1, 2), ("LBNHC", 1, 2), ("LBNHC", 2, 2), ("LHBNC", 1, 2),
              ("BLHNC", 1, 2), ("BLNHC", 1, 2), ("BHLNC", 1, 2), ("LBNHC", 2, 1)]


@pytest.mark.skipif(not nixl.available(), reason=nixl.INSTALL_HINT)
@pytest.mark.parametrize(("order", "k", "heads"), NIXL_CASES)
def test_any_stride_order_moves_byte_for_byte_over_nixl(order: str, k: int,
                                                        heads: int) -> None:
    shape = dict(order=order, layers=3, k=k, heads=heads, tokens=2, content=8,
                 dtype=torch.bfloat16)
    p, d = views(blocks=10, fill=True, **shape), views(blocks=7, **shape)
    pc, dc = layer_cache(p, 10), layer_cache(d, 7)
    remote, local = [4, 5, 6, 0, 9, 2], [1, 2, 3, 6, 0, 5]  # runs differ on each side
    move_over_nixl(pc, dc, remote, local)
    assert_moved(p, d, remote, local, k)


@pytest.mark.parametrize(("order", "per_run"), [
    ("LBHNC", 3), ("LBNHC", 3),  # a block of a layer is one page: one range per layer
    ("LHBNC", 3 * 2),  # heads outside blocks: one per layer and head
    ("BLHNC", 1), ("BLNHC", 1),  # a run of blocks is one piece across all layers
    ("BHLNC", 1)])
def test_runs_of_blocks_coalesce_into_one_range_per_contiguous_span(order: str,
                                                                   per_run: int) -> None:
    cache = layer_cache(views(order, 3, 8, 1, 2, 4, 8, torch.float16), 8)
    assert len(cache.placement.ranges([2, 3, 4, 5])) == per_run
    assert len(cache.placement.ranges([2, 4])) == 2 * per_run
    padded = layer_cache(views(order, 3, 8, 1, 2, 4, 8, torch.float16, pad=8), 8)
    assert len(padded.placement.ranges([2, 3, 4, 5])) >= 4 * min(per_run, 3)


def test_todays_cpu_layout_keeps_its_name_and_compat_hash() -> None:
    """A rolling upgrade keeps pulling: vLLM-CPU's cache (contiguous LBHNC, kernel block
    == manager block) hashes as before layouts were descriptions. The value is what the
    code before this change computed for this geometry (commit a4710fa)."""
    storage = torch.zeros(3, 16, 2, 4, 16)
    cache = layer_cache({f"model.layers.{i}.self_attn.attn": storage[i] for i in range(3)},
                        16, "CPU_ATTN")
    assert cache.layout.name == "regions:3x512"
    g = KvGeometry(architecture="Qwen2ForCausalLM", num_layers=3, num_kv_heads=2,
                   head_dim=8, block_size=4, dtype="float32", layout=cache.layout.name)
    assert g.compat_hash("vllm:Qwen/Qwen2.5-0.5B-Instruct") == "932cbe7c08b63954"


def test_what_the_description_covers_changes_the_name() -> None:
    base = dict(order="LBHNC", layers=2, blocks=4, k=1, heads=2, tokens=4, content=8,
                dtype=torch.float16)
    names = {
        layer_cache(views(**{**base, **change}), 4, backend).layout.name
        for change, backend in [({}, ""), ({"order": "LBNHC"}, ""), ({"k": 2}, ""),
                                ({"order": "LBNHC", "dtype": torch.float32,
                                  "content": 4}, ""),
                                ({}, "FLASHINFER"), ({"order": "BLHNC"}, "")]}
    assert len(names) == 6  # (regions: names bytes; KvGeometry hashes the dtype)
    # what is each side's own is not part of it: padding, allocation, block count
    same = {layer_cache(views(**{**base, **change}), change.get("blocks", 4)).layout.name
            for change in [{"order": "LBNHC"}, {"order": "LBNHC", "pad": 4},
                           {"order": "LBNHC", "apart": True},
                           {"order": "LBNHC", "blocks": 9}]}
    assert len(same) == 1, same
    # MLA: one head, so LBHNC and LBNHC are the same bytes and the same name
    mla = {layer_cache(views(**{**base, "heads": 1, "order": o, "k": 2}), 4,
                       "FLASHMLA").layout.name for o in ("LBHNC", "LBNHC")}
    assert len(mla) == 1 and ":LBKNC:" in mla.pop()


def test_a_layout_the_transport_cannot_move_is_refused_by_name() -> None:
    v = views("LBHNC", 2, 4, 1, 2, 4, 8, torch.float32)
    overlapping = {n: torch.as_strided(t, t.shape, (t.stride(0), 0, *t.stride()[2:]))
                   for n, t in v.items()}
    with pytest.raises(ValueError, match=r"KV layer model.layers.0.attn: .* overlap in dim H"):
        layer_cache(overlapping)
    with pytest.raises(ValueError, match=r"KV layer model.layers.1.attn: .* differs from"):
        layer_cache({**v, "model.layers.1.attn": v["model.layers.1.attn"][:, :1]})
    with pytest.raises(ValueError, match="4 kernel blocks do not cut into 3 manager"):
        layer_cache(v, 3)
    meta = {"model.layers.0.attn": torch.empty(4, 2, 4, 8, device="meta")}
    with pytest.raises(ValueError, match=r"model.layers.0.attn: .*host memory or on a CUDA "
                                         r"device, got meta"):
        layer_cache(meta)
    with pytest.raises(ValueError, match="no KV layers"):
        layer_cache({})


@pytest.fixture
def prefill_lbhnc() -> Iterator[str]:
    from kvrelay.vllm.prefill import PrefillSide
    from kvrelay.vllm.settings import ConnectorSettings

    cache = layer_cache(views("LBHNC", 2, 4, 1, 2, 4, 8, torch.float32), 4)
    p = PrefillSide(ConnectorSettings(), cache, "c0", "P1")
    try:
        yield p.server.address
    finally:
        p.close()


def test_hello_refuses_another_layout_naming_both(prefill_lbhnc: str) -> None:
    from kvrelay.relay.client import RelayClient

    theirs = layer_cache(views("LBNHC", 2, 4, 1, 2, 4, 8, torch.float32), 4).layout.name
    client = RelayClient(compat="c0", layout=theirs, transport="tcp", client_id="d")
    with pytest.raises(RelayUnavailable) as err:
        client.open(prefill_lbhnc)
    assert "regions:2x256" in str(err.value) and theirs in str(err.value)


def test_the_description_reads_only_shapes_and_strides() -> None:
    """Device-agnostic: a cache on a device with no host bytes (meta, as CUDA's would
    be) is described as the same cache in host memory is; only tcp's host view refuses."""
    from kvrelay.relay.transports.layout import describe

    host = views("LBNHC", 2, 4, 1, 2, 4, 8, torch.float16)
    raw = torch.empty(2 * 4 * 2 * 4 * 8, dtype=torch.float16, device="meta")
    meta = {f"model.layers.{i}.attn": torch.as_strided(raw, (2, 4, 2, 4, 8),
                                                       (256, 64, 8, 16, 1))[i]
            for i in range(2)}
    placement, _ = describe(meta, 4)
    assert placement.layout == layer_cache(host, 4).layout


def head_slices(k: int, cache: Any) -> list[Any]:
    """D's cache cut for a prefill engine of ``k`` times its workers: slice ``i`` is
    heads ``i*n .. i*n+n-1`` (n = heads / k), named as a cache of those heads alone (the
    connector's heterogeneous TP)."""
    return [named_as(head_part(cache, i, k), cache) for i in range(k)]


def assert_heads_moved(ps: list[dict[str, torch.Tensor]], d: dict[str, torch.Tensor],
                       remote: list[int], local: list[int], k: int, n: int) -> None:
    """D's heads ``i*n ..`` of block ``local[j]`` are P rank ``i``'s block ``remote[j]``
    (torch's own indexing is the oracle); D holds nothing else."""
    for i, p in enumerate(ps):
        for name in p:
            for r, lb in zip(remote, local, strict=True):
                got = d[name][lb * k:(lb + 1) * k, i * n:(i + 1) * n].contiguous()
                want = p[name][r * k:(r + 1) * k].contiguous()
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                    i, name, r, lb)
    for name in d:
        for lb in local:
            d[name][lb * k:(lb + 1) * k].zero_()
    for v in d.values():
        assert not v.view(torch.uint8).any(), "bytes outside the blocks read were written"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from([2, 3]))
def test_head_slices_of_a_smaller_tp_size_take_each_ranks_blocks_byte_for_byte(
        c: dict, ranks: int) -> None:
    """P at ``ranks`` times D's tensor-parallel size: D's worker cut into one head slice
    per P rank; each slice carries the name of P's rank's cache (what HELLO compares),
    and P's ranks' blocks land in their slices over tcp, byte for byte, in every
    stride order vLLM has (MLA has no heads to split: left out)."""
    n = c["heads"]
    shape = {x: c[x] for x in ("order", "layers", "k", "tokens", "content", "dtype", "pad",
                               "apart")}
    ps = [views(blocks=c["blocks"][0], heads=n, fill=True, **shape) for _ in range(ranks)]
    d = views(blocks=c["blocks"][1], heads=n * ranks, **shape)
    whole = layer_cache(d, c["blocks"][1])
    for p, part in zip(ps, head_slices(ranks, whole), strict=True):
        pc = layer_cache(p, c["blocks"][0])
        assert part.layout.name == pc.layout.name
        move_over_tcp(pc, part, c["remote"], c["local"])
    assert_heads_moved(ps, d, c["remote"], c["local"], c["k"], n)


@pytest.mark.skipif(not nixl.available(), reason=nixl.INSTALL_HINT)
@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "BLNHC"])
def test_head_slices_take_each_ranks_blocks_over_nixl(order: str) -> None:
    """The same through NIXL READs, each slice's own agent over the one D cache."""
    shape = dict(order=order, layers=3, k=1, tokens=2, content=8, dtype=torch.bfloat16)
    ps = [views(blocks=10, heads=2, fill=True, **shape) for _ in range(2)]
    d = views(blocks=7, heads=4, **shape)
    remote, local = [4, 5, 6, 0, 9, 2], [1, 2, 3, 6, 0, 5]
    for p, part in zip(ps, head_slices(2, layer_cache(d, 7)), strict=True):
        move_over_nixl(layer_cache(p, 10), part, remote, local)
    assert_heads_moved(ps, d, remote, local, 1, 2)


def test_a_head_slice_of_todays_cpu_cache_is_named_as_that_ranks_cache() -> None:
    """P at TP 2 (2 heads a rank, vLLM-CPU's contiguous LBHNC) and D at TP 1 (4 heads):
    each of D's slices is named ``regions:`` as P's rank's cache is, and hashes alike."""
    p = layer_cache({f"l{i}": torch.zeros(3, 8, 2, 4, 16)[i] for i in range(3)}, 8,
                    "CPU_ATTN")
    d4 = torch.zeros(3, 8, 4, 4, 16)
    d = {f"l{i}": d4[i] for i in range(3)}
    for part in head_slices(2, layer_cache(d, 8, "CPU_ATTN")):
        assert part.layout.name == p.layout.name == "regions:3x512"
        assert len(part.placement.ranges([0, 1])) == 3 * 2  # strided: a range per block
