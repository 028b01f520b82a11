"""lm-evaluation-harness's multiple choice against kvrelay: the real ``lm_eval`` CLI (a
subprocess, ``--model local-completions``, a local HF tokenizer directory, no hub) runs a
YAML task over a jsonl file this test writes, against a colocated engine and 1P1D behind
the proxy. Every choice's log-likelihood, and the task's acc and acc_norm, must equal
what transformers computes for the same items in float32.

lm-eval scores a choice with ``{"prompt": [context + continuation ids], "max_tokens": 1,
"logprobs": 1, "echo": true}``: the sum of the echoed prompt logprobs of the continuation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import Proc, colocated_and_pd, env, metric, metrics, pools_free

# Hang guards only: the CLI imports datasets, pandas and scikit-learn before its first
# request, minutes on a 2-core machine under load (117 s at load average 25).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# lm-eval 0.4.13's chat model changes its requests for names holding "5", "o1", "o3", "o4".
SERVED = "tiny-mc"
TASK = "kvrelay_tiny_mc"
# Choices of different lengths, so acc (raw log-likelihood) and acc_norm (per character)
# can pick differently.
ITEMS: list[dict[str, Any]] = [
    {"question": "What is the capital of France?",
     "choices": ["Paris", "the lazy dog", "a fox"], "answer": 0},
    {"question": "The quick brown fox jumps over the",
     "choices": ["lazy dog.", "cat", "small model that answered"], "answer": 0},
    {"question": "Once upon a time there was a",
     "choices": ["small model", "café", "question of every time"], "answer": 1},
    {"question": "Hello",
     "choices": ["world", "brown fox jumps", "emoji"], "answer": 2},
    {"question": "Which animal is quick?",
     "choices": ["the fox", "the dog", "the capital"], "answer": 1},
    {"question": "Paris is the capital of",
     "choices": ["France.", "the world", "naïve"], "answer": 0},
]
# The items as a task: its name, data and prompt (format fields: task, data).
TASK_HEAD = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "Q: {{{{question}}}}\\nA:"
"""
TASK_YAML = TASK_HEAD + """\
output_type: multiple_choice
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


# Greedy answers to the same questions: through P/D, D decodes them on P's KV.
GEN_TASK = "kvrelay_tiny_gen"
GEN_TASK_YAML = TASK_HEAD + """\
output_type: generate_until
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["<|never|>"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvrelay.testing.models import write_tiny_hf_model

    return Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lm-eval-task")
    data = d / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (d / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    (d / f"{GEN_TASK}.yaml").write_text(GEN_TASK_YAML.format(task=GEN_TASK, data=data))
    return d


def _encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's own split (TemplateLM._encode_pair): the context's trailing spaces move
    to the continuation, whose ids are the whole text's after the context's; no BOS."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, Any]:
    return transformers_scores(model_dir)


def transformers_scores(model_dir: Path) -> dict[str, Any]:
    """transformers' log-likelihood of every choice, and the task's acc and acc_norm."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                              dtype=torch.float32)
    lls, acc, acc_norm = [], 0, 0
    for item in ITEMS:
        context = f"Q: {item['question']}\nA: "  # doc_to_text + the default delimiter " "
        scores = []
        for choice in item["choices"]:
            ctx, cont = _encode_pair(tok, context, choice)
            ids = ctx + cont
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            scores.append(sum(float(lp[i - 1, ids[i]]) for i in range(len(ctx), len(ids))))
        lls.append(scores)
        acc += max(range(len(scores)), key=lambda i: (scores[i], -i)) == item["answer"]
        norm = [s / len(c) for s, c in zip(scores, item["choices"], strict=True)]
        acc_norm += max(range(len(norm)), key=lambda i: (norm[i], -i)) == item["answer"]
    return {"lls": lls, "acc": acc / len(ITEMS), "acc_norm": acc_norm / len(ITEMS)}


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Proc]]:
    logs = tmp_path_factory.mktemp("lm-eval-logs")
    with colocated_and_pd(model_dir, logs, "--served-model-name", SERVED) as (_, procs):
        yield procs


def _lm_eval(base: str, model_dir: Path, task_dir: Path, out: Path,
             tasks: tuple[str, ...] = (TASK,)) -> dict[str, Any]:
    """One run of the real CLI over ``tasks``; the results and logged samples of the
    first, and of each by name under "tasks"."""
    home = out / "hf-home"
    cmd = [str(Path(sys.executable).with_name("lm_eval")), "run",
           "--model", "local-completions",
           "--model_args", f"base_url={base}/v1/completions,model={SERVED},"
           f"tokenizer={model_dir},tokenizer_backend=huggingface,max_retries=1",
           "--tasks", ",".join(tasks), "--include_path", str(task_dir), "--batch_size", "4",
           "--output_path", str(out), "--log_samples"]
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HOME": str(home), "HF_DATASETS_CACHE": str(home / "datasets"),
               "OPENAI_API_KEY": "unused", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(cmd, env=env(offline), capture_output=True, text=True, timeout=600,
                       cwd=out)
    assert r.returncode == 0, f"lm_eval failed ({r.returncode}):\n{r.stdout[-3000:]}\n" \
        f"{r.stderr[-6000:]}"
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    by_task = {}
    for task in tasks:
        samples = next(out.rglob(f"samples_{task}_*.jsonl"))
        docs = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
        by_task[task] = {"results": results[task], "samples": docs}
    return {**by_task[tasks[0]], "tasks": by_task}


@pytest.mark.parametrize("where", ["colo", "proxy"])
def test_lm_eval_multiple_choice_equals_transformers(
        cluster: dict[str, Proc], model_dir: Path, task_dir: Path, reference: dict[str, Any],
        tmp_path: Path, where: str) -> None:
    run = _lm_eval(cluster[where].url, model_dir, task_dir, tmp_path)
    assert len(run["samples"]) == len(ITEMS)
    for doc in run["samples"]:
        i = doc["doc_id"]
        mine = [float(resp[0][0]) for resp in doc["resps"]]
        assert mine == pytest.approx(reference["lls"][i], abs=1e-4), f"item {i}"
    res = run["results"]
    assert res["acc,none"] == pytest.approx(reference["acc"])
    assert res["acc_norm,none"] == pytest.approx(reference["acc_norm"])
    pools_free(cluster["d"], prefill=(cluster["p"],), timeout=10)


@pytest.fixture(scope="module")
def cluster_fp8(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[dict[str, Proc]]:
    logs = tmp_path_factory.mktemp("lm-eval-fp8-logs")
    with colocated_and_pd(model_dir, logs, "--served-model-name", SERVED,
                          "--kv-cache-dtype", "fp8") as (_, procs):
        yield procs


def test_lm_eval_through_pd_with_fp8_kv_scores_as_colocated_fp8(
        cluster_fp8: dict[str, Proc], model_dir: Path, task_dir: Path,
        reference: dict[str, Any], tmp_path: Path) -> None:
    """Both tasks with every engine's KV in fp8 (--kv-cache-dtype fp8). Through P/D the
    multiple choice's log-likelihoods, acc and acc_norm equal the colocated fp8 engine's
    (P scores prompts: prefixes shared between choices come from its fp8 prefix cache),
    and so do the greedy answers and their score (D decodes them on P's 8-bit blocks).
    Against float32 (transformers) the 8-bit KV moves the log-likelihoods, a little."""
    runs = {}
    d = cluster_fp8["d"]
    moved = metric(metrics(d.url), "kvrelay_kv_transfer_bytes_total")
    for where in ("colo", "proxy"):
        (tmp_path / where).mkdir()
        runs[where] = _lm_eval(cluster_fp8[where].url, model_dir, task_dir, tmp_path / where,
                               (TASK, GEN_TASK))
    assert metric(metrics(d.url), "kvrelay_kv_transfer_bytes_total") > moved  # D pulled
    lls = {where: {doc["doc_id"]: [float(resp[0][0]) for resp in doc["resps"]]
                   for doc in run["samples"]} for where, run in runs.items()}
    assert sorted(lls["proxy"]) == list(range(len(ITEMS)))
    for i in range(len(ITEMS)):
        # float32 sums of per-token logprobs: equal to their last bits or two
        assert lls["proxy"][i] == pytest.approx(lls["colo"][i], rel=1e-6), f"item {i}"
        assert lls["colo"][i] == pytest.approx(reference["lls"][i], abs=0.5), f"item {i}"
    assert any(lls["colo"][i] != pytest.approx(reference["lls"][i], abs=1e-4)
               for i in range(len(ITEMS)))  # the cache really was 8-bit
    for metric_name in ("acc,none", "acc_norm,none"):
        assert runs["proxy"]["results"][metric_name] == runs["colo"]["results"][metric_name]
    answers = {where: {doc["doc_id"]: doc["resps"][0][0]
                       for doc in run["tasks"][GEN_TASK]["samples"]}
               for where, run in runs.items()}
    assert answers["proxy"] == answers["colo"] and all(answers["colo"].values())
    gen = {where: run["tasks"][GEN_TASK]["results"]["exact_match,none"]
           for where, run in runs.items()}
    assert gen["proxy"] == gen["colo"]
    pools_free(cluster_fp8["d"], prefill=(cluster_fp8["p"],), timeout=10)
