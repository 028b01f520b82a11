"""2 MiB pages under the decode weights and the KV cache (kvrelay.model.kernels.hugepages)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.model.kernels import hugepages


def _thp_mode() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text.partition("[")[2].partition("]")[0] or "unknown"


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):
                if fields is not None:
                    return fields
                lo, hi = (int(x, 16) for x in head.split("-"))
                fields = {} if lo <= address < hi else None
            elif fields is not None:
                fields[head.rstrip(":")] = rest.strip()
    if fields is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return fields


def test_arena_copies_in_order_aligned_and_in_chunks() -> None:
    arena = hugepages.Arena(chunk_bytes=4 << 20)
    ts = [torch.randn(3, 5).bfloat16(), torch.arange(7, dtype=torch.int64),
          torch.randn(1000, 33), torch.randn(2 << 20)]  # the last (8 MiB) takes a chunk
    out = [arena.copy(t) for t in ts]
    assert all(o.dtype == t.dtype and torch.equal(o, t) for o, t in zip(out, ts, strict=True))
    assert out[0].data_ptr() % hugepages.HUGE_PAGE == 0  # a chunk starts on a 2 MiB page
    assert all(o.data_ptr() % 64 == 0 for o in out)
    storages = [o.untyped_storage().data_ptr() for o in out]
    assert storages[0] == storages[1] == storages[2] != storages[3]
    ts[2].zero_()
    assert out[2].abs().sum() > 0  # copies, not views of the inputs


def test_zeros_are_zero_and_lazily_committed() -> None:
    z = hugepages.zeros((64, 1024, 1024), torch.bfloat16)  # 128 MiB
    assert z.shape == (64, 1024, 1024) and z.dtype == torch.bfloat16
    assert z[::7, ::97, ::89].abs().sum() == 0
    assert int(_mapping_of(z.data_ptr())["Rss"].split()[0]) < 64 << 10  # kB: mostly untouched


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always") or not hugepages.enabled(),
                    reason="transparent huge pages are off on this machine")
def test_arena_and_cache_memory_is_advised_and_faults_in_as_huge_pages() -> None:
    (w,) = [hugepages.Arena().copy(torch.randn(4096, 2048).bfloat16())]  # 16 MiB
    cache = hugepages.zeros((8 << 20,), torch.float32)
    for t in (w, cache):
        assert "hg" in _mapping_of(t.data_ptr())["VmFlags"].split()  # MADV_HUGEPAGE
    cache[:] = 1.0
    assert int(_mapping_of(w.data_ptr())["AnonHugePages"].split()[0]) >= 2048
    assert int(_mapping_of(cache.data_ptr())["AnonHugePages"].split()[0]) >= 2048


def test_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_HUGEPAGES", "0")
    assert not hugepages.enabled()
    t = hugepages.zeros((8 << 20,), torch.uint8)
    assert "hg" not in _mapping_of(t.data_ptr())["VmFlags"].split()


def _kernel_at_least(major: int, minor: int) -> bool:
    import platform

    try:
        got = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)


@pytest.mark.skipif(not _kernel_at_least(5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_populate_faults_the_cache_in_without_changing_a_byte() -> None:
    """The KV cache's pages are faulted in on a background thread (the steps that first
    write them paid for it), while the engine may write the same memory: nothing it
    wrote before or meanwhile changes, and afterwards the mapping is resident."""
    t = hugepages.zeros((64 << 20,), torch.uint8)
    t[: 1 << 20 : 65536] = 7  # written before (the first 2 MiB page only)
    assert int(_mapping_of(t.data_ptr())["Rss"].split()[0]) <= 4 << 10  # kB
    th = hugepages.populate_in_background(t, chunk_bytes=4 << 20)
    t[12345] = 9  # written meanwhile
    th.join(60)
    assert not th.is_alive()
    assert int(_mapping_of(t.data_ptr())["Rss"].split()[0]) >= 60 << 10  # kB
    assert t[12345] == 9 and (t[: 1 << 20 : 65536] == 7).all()
    assert int(t.sum()) == 7 * 16 + 9


def test_populate_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    assert hugepages.populate_wanted() == (sys.platform == "linux")
    monkeypatch.setenv("KVRELAY_KV_POPULATE", "0")
    assert not hugepages.populate_wanted()
