"""vLLM's ``/tokenize`` and ``/detokenize`` on every role of a real served model and
through the proxy; the expected ids come from transformers' tokenizer of the same
directory (an independent implementation of the same tokenizer and template)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Proc, colocated_and_pd

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ROLES = ("colo", "p", "d", "proxy")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvrelay.testing.models import write_tiny_hf_model

    return Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    with colocated_and_pd(model_dir, tmp_path_factory.mktemp("tokenize-logs")) as (_, procs):
        yield procs


def _post(proc: Proc, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(proc.url + path, json=body, timeout=30)


@pytest.mark.parametrize("role", ROLES)
def test_tokenize_a_prompt_and_messages_as_vllm(
        cluster: dict[str, Proc], model_dir: Path, ref: Any, role: str) -> None:
    proc, text = cluster[role], "The quick brown fox jumps"
    r = _post(proc, "/tokenize", {"model": model_dir.name, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    want = ref(text, add_special_tokens=True)["input_ids"]
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == 512
    r = _post(proc, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert r.json()["tokens"] == ref(text, add_special_tokens=False)["input_ids"]
    for gen in (True, False):
        want = ref.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=gen)
        if hasattr(want, "keys"):  # newer transformers return a BatchEncoding
            want = want["input_ids"]
        r = _post(proc, "/tokenize", {"model": model_dir.name, "messages": MESSAGES,
                                      "add_generation_prompt": gen})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == list(want), gen


@pytest.mark.parametrize("role", ROLES)
def test_detokenize_round_trips(cluster: dict[str, Proc], ref: Any, role: str) -> None:
    ids = ref("Once upon a time", add_special_tokens=False)["input_ids"]
    r = _post(cluster[role], "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": ref.decode(ids)}


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
    ("/tokenize", {"prompt": "a", "return_token_strs": True}, 400, "return_token_strs"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_requests_name_the_field(cluster: dict[str, Proc], role: str, path: str,
                                     body: dict[str, Any], status: int, param: str) -> None:
    r = _post(cluster[role], path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
