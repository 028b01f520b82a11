"""2 MiB pages under the decode weights and the KV cache (kvrelay.model.hugepages)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.model import hugepages


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_gather_copies_into_one_aligned_buffer() -> None:
    ts = [torch.randn(3, 5).bfloat16(), torch.arange(7, dtype=torch.int64),
          torch.randn(1000, 33)]
    out = hugepages.gather(ts)
    assert [o.dtype for o in out] == [t.dtype for t in ts]
    assert all(torch.equal(o, t) for o, t in zip(out, ts, strict=True))
    assert out[0].data_ptr() % hugepages.HUGE_PAGE == 0
    assert all(o.data_ptr() % 64 == 0 for o in out)
    assert len({o.untyped_storage().data_ptr() for o in out}) == 1  # one buffer
    ts[2].zero_()
    assert out[2].abs().sum() > 0  # copies, not views of the inputs


@pytest.mark.skipif(hugepages.thp_mode() not in ("madvise", "always") or not hugepages.enabled(),
                    reason="transparent huge pages are off on this machine")
def test_gathered_weights_fault_in_as_huge_pages() -> None:
    w = torch.randn(4096, 2048).bfloat16()  # 16 MiB
    (g,) = hugepages.gather([w])
    assert torch.equal(g, w)
    assert _huge_kib_at(g.data_ptr()) >= 2048


def test_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_HUGEPAGES", "0")
    assert not hugepages.enabled()
    assert not hugepages.advise(torch.empty(8 << 20, dtype=torch.uint8))
