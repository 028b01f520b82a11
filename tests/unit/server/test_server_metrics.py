"""The engine's /metrics on stand-in model parts: exact per-request counts, queue time,
preemptions, and model_name on every series."""

from __future__ import annotations

import concurrent.futures

import openai

from tests.metrics_util import metrics, sample, wait_blocks_back
from tests.unit.server.fakes import expected_letters, make_state, serve_in_thread


def test_per_request_histograms_count_each_choice() -> None:
    with serve_in_thread(make_state(delay_s=0.002)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        m0 = metrics(url)
        r = c.completions.create(model="tiny", prompt="hello", max_tokens=7, n=2, seed=4)
        assert r.usage is not None and r.usage.completion_tokens == 14
        m1 = wait_blocks_back(url, 5.0)

    def delta(name: str) -> float:
        return sample(m1, name) - sample(m0, name)

    # "hello" is 6 tokens (BOS + 5 bytes); each choice is one engine request.
    assert delta("kvrelay_prompt_tokens_total") == 12
    assert (delta("kvrelay_request_prompt_tokens_count"),
            delta("kvrelay_request_prompt_tokens_sum")) == (2, 12)
    assert (delta("kvrelay_request_generation_tokens_count"),
            delta("kvrelay_request_generation_tokens_sum")) == (2, 14)
    assert delta("kvrelay_generation_tokens_total") == 14
    assert delta("kvrelay_request_queue_time_seconds_count") == 2
    assert delta("kvrelay_e2e_request_latency_seconds_count") == 2
    assert sample(m1, "kvrelay_requests_finished_total", reason="length") == 2
    series = [k for k in m1 if k.startswith("kvrelay_")]
    assert series and all('model_name="tiny"' in k for k in series), [
        k for k in series if 'model_name="tiny"' not in k]
    assert not any(k.split("{")[0].endswith("_created") for k in m1)


def test_preemptions_are_exported() -> None:
    """Two requests that each need 7 of the pool's 8 blocks: one is preempted (its
    blocks freed, recomputed later), both still answer exactly."""
    with serve_in_thread(make_state(num_blocks=8, max_model_len=32, delay_s=0.003)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert sample(metrics(url), "kvrelay_preemptions_total", model_name="tiny") == 0
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(c.completions.create, model="tiny", prompt="ab",
                                   max_tokens=25, seed=s) for s in (1, 2)]
            texts = [f.result().choices[0].text for f in futures]
        assert texts == [expected_letters(s, 3, 25) for s in (1, 2)]
        m = wait_blocks_back(url, 5.0)
    assert sample(m, "kvrelay_preemptions_total", model_name="tiny") >= 1
