"""Faults inside the connector, in real vLLM processes (`make test-vllm-slow`,
KVRELAY_VLLM_SLOW=1; not in `make test`): one module-scoped pair (pair.py, tcp) whose P
worker makes every step's leases 0.5 s late (KVRELAY_FAULT_VLLM_HOLD_DELAY_S: D's
ACQUIRE meets NOT_YET until then) and whose D worker raises on its 2nd load and on the
6th relay reply it applies (KVRELAY_FAULT_VLLM_RAISE). vLLM's own schedulers meet every
fault kind, and many more interleavings, in tests/vllm/test_vllm_harness.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm.pair import (
    FELL_BACK,
    PULLING,
    SLOW_MARKS,
    Pair,
    colocated,
    completion,
    start_pair,
)

pytestmark = SLOW_MARKS


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    yield from start_pair(
        tmp_path_factory.mktemp("vllm-faults"), "tcp", "kv_producer",
        p_env={"KVRELAY_FAULT_VLLM_HOLD_DELAY_S": "0.5"},
        d_env={"KVRELAY_FAULT_VLLM_RAISE": "submit:2,reply:6"})


def test_late_leases_and_thread_faults_fail_one_load_each(pair: Pair) -> None:
    """Six requests through the proxy, one after another: each gets the colocated text.
    The leases made late are waited for (no fallback for them); the load whose submit
    raised and the one whose reply raised fall back alone (recompute); P ends every
    lease it made, and both engines' KV pools come back whole."""
    want = colocated(pair)
    made = pair.p.count(r"kvrelay: lease \S+ for request")
    ended = pair.p.count(r"kvrelay: lease \S+ of request \S+ ended")
    for _ in range(6):
        assert completion(pair.proxy_url, False) == want
    assert pair.d.count(r"kvrelay: submit of request \S+ failed") == 1
    assert pair.d.count(r"kvrelay: on_reply of request \S+ failed") == 1
    assert pair.d.count(FELL_BACK) == 2, pair.d.tail()
    assert pair.d.count(PULLING) >= 4
    leases = pair.p.count(r"kvrelay: lease \S+ for request") - made
    assert leases == 6
    pair.p.wait_log(r"kvrelay: lease \S+ of request \S+ ended", ended + leases, timeout=30)
    pair.p.wait_kv_free(timeout=30)
    pair.d.wait_kv_free(timeout=30)
