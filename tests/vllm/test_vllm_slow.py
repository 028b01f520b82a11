"""The slow vLLM variants (`make test-vllm-slow`, KVRELAY_VLLM_SLOW=1; not in `make test`):
the scenarios of test_vllm_pd.py that take a transport, over nixl (NIXL over UCX, CPU
memory), and a storm of aborts, on one module-scoped pair (pair.py): P kv_producer, D
kv_consumer, both started with --async-scheduling (which vLLM's CPU platform turns off:
vllm/platforms/cpu.py, ``check_and_update_config``: "async scheduling is not required
on CPU").
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import httpx
import pytest

from kvrelay.relay.transports import nixl
from tests.vllm.pair import (
    LEASE_TIMEOUT,
    PROMPT,
    SLOW_MARKS,
    Pair,
    colocated,
    completion,
    start_pair,
)
from tests.vllm.test_vllm_pd import (  # collected here too, on this module's pair
    test_a_partial_pull_moves_only_the_blocks_d_lacks,
    test_blocks_reused_under_a_delayed_pull_are_fenced,
    test_replayed_params_never_commit,
    test_texts_equal_colocated_vllm,
)

pytestmark = [
    *SLOW_MARKS,
    pytest.mark.skipif(not nixl.available(), reason=nixl.INSTALL_HINT),
]
__all__ = ["test_a_partial_pull_moves_only_the_blocks_d_lacks",
           "test_blocks_reused_under_a_delayed_pull_are_fenced",
           "test_replayed_params_never_commit", "test_texts_equal_colocated_vllm"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    yield from start_pair(tmp_path_factory.mktemp("vllm-slow"), "nixl", "kv_producer",
                          ("--async-scheduling",))


def _client_that_leaves(url: str, leave_after: int, timeout: float) -> None:
    """Streams PROMPT through the proxy and hangs up after ``leave_after`` events (0:
    as soon as the answer starts) or after ``timeout`` s, whichever is first."""
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
            "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body,
                          timeout=timeout) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= leave_after:
                    return
    except httpx.HTTPError:
        pass  # left early: the point


def test_an_abort_storm_leaves_both_engines_serving_and_every_block_free(pair: Pair) -> None:
    """Clients leave at every stage (P prefilling, D waiting for KV, mid-decode), eight
    at a time: both engines stay up, every lease P made ends, every block of both
    engines is free again, and the text is still colocated vLLM's."""
    want = colocated(pair)
    rng = random.Random(20)
    made = pair.p.count(r"kvrelay: lease \S+ for request")
    ended = pair.p.count(r"kvrelay: lease \S+ of request \S+ ended")
    threads = [threading.Thread(target=_client_that_leaves, args=(
        pair.proxy_url, rng.choice([0, 1, 3, 99]), rng.choice([0.2, 0.6, 1.2, 3.0, 30.0])))
        for _ in range(48)]
    for i in range(0, len(threads), 8):
        for t in threads[i:i + 8]:
            t.start()
        for t in threads[i:i + 8]:
            t.join(120)
    for engine in (pair.p, pair.d):
        assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200
    leases = pair.p.count(r"kvrelay: lease \S+ for request") - made
    assert leases > 0
    # Every lease ends: done, aborted (D told P) or, at worst, expired.
    pair.p.wait_log(r"kvrelay: lease \S+ of request \S+ ended", ended + leases,
                    timeout=4 * LEASE_TIMEOUT)
    pair.p.wait_kv_free(timeout=4 * LEASE_TIMEOUT)
    pair.d.wait_kv_free(timeout=4 * LEASE_TIMEOUT)
    assert pair.p.count(r"kvrelay: lease \S+ of request \S+ ended") == ended + leases
    assert completion(pair.proxy_url, False) == want
    # The connector's metrics, as vLLM's stat logger prints them (every 10 s).
    pair.d.wait_log(r"KV Transfer metrics: Num successful pulls=[1-9]", 1, timeout=30)
    pair.p.wait_log(r"KV Transfer metrics: .*Leases \w+=[1-9]", 1, timeout=30)
