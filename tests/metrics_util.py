"""Reading a kvrelay server's /metrics in tests."""

from __future__ import annotations

import time

import httpx


def metrics(url: str) -> dict[str, float]:
    """Every sample of ``url``/metrics by name (labels included)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def sample(m: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (others, such as
    model_name, may be present too)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for key, value in m.items():
        base, _, rest = key.partition("{")
        if base == name and all(w in rest[:-1].split(",") for w in want):
            total += value
    return total


def blocks_released(m: dict[str, float]) -> tuple[float, float]:
    """(free + cached, total): equal when no request or lease holds a block (cached
    blocks keep a prefix for later hits and are evicted on demand)."""
    back = sample(m, "kvrelay_kv_blocks_free") + sample(m, "kvrelay_kv_blocks_cached")
    return back, sample(m, "kvrelay_kv_blocks_total")


def wait_blocks_back(url: str, timeout: float) -> dict[str, float]:
    """Wait until every KV block is free or cached again; the metrics at that moment."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        back, total = blocks_released(m)
        if back == total:
            return m
        assert time.monotonic() < deadline, f"KV blocks not returned: {m}"
        time.sleep(0.02)
