"""vLLM's metric names on a kvrelay engine's /metrics, read as the routers and
autoscalers that know vLLM read them: parsed by prometheus_client's own parser, each
name with vLLM's type, labels and buckets, and values that move with load."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.server import vllm_metrics
from tests.unit.server.fakes import make_state, serve_in_thread

# name -> type, as vLLM 0.34 declares them (vllm/v1/metrics/loggers.py)
VLLM_NAMES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}


def scrape(url: str) -> dict[str, object]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict[str, object], name: str, suffix: str = "", **labels: str) -> float:
    fam = families[name]
    return sum(s.value for s in fam.samples
               if s.name == name + suffix and all(s.labels.get(k) == v
                                                  for k, v in labels.items()))


def test_vllm_names_types_labels_and_buckets() -> None:
    with serve_in_thread(make_state(max_model_len=128)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        c.completions.create(model="tiny", prompt="hello", max_tokens=5, seed=1)
        c.completions.create(model="tiny", prompt="hello", max_tokens=50, seed=2)
        fams = scrape(url)
    for name, kind in VLLM_NAMES.items():
        assert name in fams, f"{name} missing"
        fam = fams[name]
        assert fam.type == kind, (name, fam.type)
        for s in fam.samples:
            keys = set(s.labels) - {"le"}
            if name == "vllm:cache_config_info":
                assert {"block_size", "num_gpu_blocks", "engine"} <= keys
                assert "model_name" not in keys  # as vLLM: the cache config alone
            elif name == "vllm:request_success":
                assert keys == {"model_name", "engine", "finished_reason"}, s
            else:
                assert keys == {"model_name", "engine"}, (name, s.labels)
            if "model_name" in keys:
                assert (s.labels["model_name"], s.labels["engine"]) == ("tiny", "0")
    info = fams["vllm:cache_config_info"].samples[0]
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"], info.value) == (
        "4", "64", 1.0)
    # Every vLLM finish reason is there from the start; the two requests ended by length.
    reasons = {s.labels["finished_reason"]: s.value
               for s in fams["vllm:request_success"].samples}
    assert set(vllm_metrics.FINISHED_REASONS) <= set(reasons)
    assert reasons["length"] == 2 and reasons["stop"] == 0
    assert value(fams, "vllm:generation_tokens", "_total") == 55
    assert value(fams, "vllm:prompt_tokens", "_total") == 12  # BOS + 5 bytes, twice
    assert value(fams, "vllm:request_generation_tokens", "_sum") == 55
    assert value(fams, "vllm:time_to_first_token_seconds", "_count") == 2
    assert value(fams, "vllm:inter_token_latency_seconds", "_count") == 53
    assert value(fams, "vllm:e2e_request_latency_seconds", "_count") == 2
    # vLLM's buckets: request_tokens is 1-2-5 up to max_model_len.
    bounds = [s.labels["le"] for s in fams["vllm:request_prompt_tokens"].samples
              if s.name.endswith("_bucket")]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]
    ttft = [float(s.labels["le"]) for s in fams["vllm:time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    assert tuple(ttft) == vllm_metrics.TIME_TO_FIRST_TOKEN_BUCKETS


def test_waiting_running_and_usage_move_with_load() -> None:
    """A burst of 6 slow requests on an engine of 2 seats: 2 run, the rest wait, the KV
    cache fills; after it, nothing runs or waits and usage is back to 0."""
    state = make_state(max_num_seqs=2, delay_s=0.02)
    with serve_in_thread(state) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        fams = scrape(url)
        assert value(fams, "vllm:kv_cache_usage_perc") == 0
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(c.completions.create, model="tiny", prompt="ab",
                                   max_tokens=40, seed=s) for s in range(6)]
            seen = (0.0, 0.0, 0.0)
            deadline = time.monotonic() + 30
            while not all(f.done() for f in futures):
                fams = scrape(url)
                now = (value(fams, "vllm:num_requests_running"),
                       value(fams, "vllm:num_requests_waiting"),
                       value(fams, "vllm:kv_cache_usage_perc"))
                seen = tuple(max(a, b) for a, b in zip(seen, now, strict=True))
                if seen[0] == 2 and seen[1] >= 1:
                    break
                assert time.monotonic() < deadline, seen
            assert all(len(f.result().choices[0].text) == 40 for f in futures)
        assert seen[0] == 2 and seen[1] >= 1 and 0 < seen[2] <= 1, seen
        deadline = time.monotonic() + 10
        while True:
            fams = scrape(url)
            now = (value(fams, "vllm:num_requests_running"),
                   value(fams, "vllm:num_requests_waiting"),
                   value(fams, "vllm:kv_cache_usage_perc"))
            if now == (0, 0, 0):
                break
            assert time.monotonic() < deadline, now
        assert value(fams, "vllm:request_success", "_total", finished_reason="length") == 6
