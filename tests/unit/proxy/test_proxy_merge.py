"""The proxy's merging of per-choice legs, on hand-written engine answers."""

from __future__ import annotations

from typing import Any

from kvrelay.proxy.legs import Leg, LegEvent
from kvrelay.proxy.merge import Frame, full_body, leg_choice, merge_logprobs, reframe


def p_answer(text: str, lp: Any, finish: str = "remote_decode") -> dict[str, Any]:
    return {"id": "cmpl-p", "model": "m", "choices": [
        {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        "kv_transfer_params": {"lease_id": "L"}}


def test_completion_logprobs_run_on_from_the_first_token() -> None:
    first = {"tokens": ["He"], "token_logprobs": [-0.5], "top_logprobs": [{"He": -0.5}],
             "text_offset": [0]}
    rest = {"tokens": ["llo", "!"], "token_logprobs": [-1.0, -2.0],
            "top_logprobs": [{"llo": -1.0}, {"!": -2.0}], "text_offset": [0, 3]}
    merged = merge_logprobs(first, rest)
    assert merged["tokens"] == ["He", "llo", "!"]
    assert merged["text_offset"] == [0, 2, 5]
    assert merged["token_logprobs"] == [-0.5, -1.0, -2.0]
    assert merge_logprobs(None, rest) is None
    assert merge_logprobs({"content": [1]}, {"content": [2, 3]}) == {"content": [1, 2, 3]}


def test_legs_merge_into_one_answer_counting_each_prompt_once() -> None:
    legs = [Leg(i, i % 2 == 0, {"max_tokens": 3}) for i in range(4)]
    choices = []
    for leg in legs:
        leg.on(LegEvent.PREFILL)
        leg.prefilled(p_answer("A", None), "http://p")
        assert leg.params == {"lease_id": "L"} and not leg.ended_at_prefill
        decoded = {"model": "m", "choices": [{"index": 0, "text": "BC", "logprobs": None,
                                              "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
        choices.append(leg_choice(leg, decoded))
    body = full_body(Frame(chat=False, id="cmpl-x"), legs, list(reversed(choices)))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "ABC" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}
    assert body["id"] == "cmpl-x"


def test_first_token_that_ends_the_choice_needs_no_decode() -> None:
    leg = Leg(0, True, {"max_tokens": 1})
    leg.on(LegEvent.PREFILL)
    leg.prefilled(p_answer("A", None), "http://p")
    assert leg.ended_at_prefill
    assert leg_choice(leg, None)["finish_reason"] == "length"  # not remote_decode
    stop = Leg(0, True, {"max_tokens": 9})
    stop.on(LegEvent.PREFILL)
    stop.prefilled({**p_answer("", None, "stop"), "kv_transfer_params": None}, "http://p")
    assert stop.ended_at_prefill and stop.params is None


def test_chat_stream_has_one_role_per_choice_and_drops_d_role_chunk() -> None:
    frame = Frame(chat=True, include_usage=True, model="m")
    leg = Leg(3, True, {})
    d_role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}
    assert reframe(frame, leg, d_role) == []
    out = reframe(frame, leg, {"index": 0, "delta": {"content": "Hi"}, "logprobs": None,
                               "finish_reason": None})
    assert [c["choices"][0]["delta"] for c in out] == [
        {"role": "assistant", "content": ""}, {"content": "Hi"}]
    assert all(c["choices"][0]["index"] == 3 and c["usage"] is None and c["id"] == frame.id
               for c in out)
    again = reframe(frame, leg, {"index": 0, "delta": {"role": "assistant", "content": "!"},
                                 "logprobs": None, "finish_reason": None})
    assert [c["choices"][0]["delta"] for c in again] == [{"content": "!"}]


def test_completion_stream_offsets_shift_by_the_text_before() -> None:
    frame = Frame(chat=False)
    lp = {"tokens": ["b", "c"], "token_logprobs": [-1.0, -1.0], "top_logprobs": [{}, {}],
          "text_offset": [0, 1]}
    (chunk,) = reframe(frame, Leg(0, True, {}), {"index": 0, "text": "bc", "logprobs": lp,
                                                 "finish_reason": None}, shift=4)
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [4, 5]
    assert "usage" not in chunk


def _vllm_leg(first_text: str) -> Leg:
    leg = Leg(0, True, {"prompt": "x", "max_tokens": 8})
    leg.on(LegEvent.PREFILL)
    leg.prefilled({"choices": [{"text": first_text, "finish_reason": "length"}],
                   "kv_transfer_params": {"lease_id": "L", "resends_first_token": True}},
                  "http://p")
    return leg


def test_a_decode_engine_that_resends_the_first_token_is_not_doubled() -> None:
    # vLLM's decode engine (kvrelay.vllm) samples token 1 again: its answer is the choice.
    leg = _vllm_leg(" Paris")
    assert leg.resends
    choice = leg_choice(leg, {"choices": [{"text": " Paris is big", "finish_reason": "length"}],
                              "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    assert choice["text"] == " Paris is big"


def test_a_stream_cuts_the_resent_first_token_across_chunks() -> None:
    from kvrelay.proxy.merge import cut_resent, seed_chunk

    leg = _vllm_leg(" Paris")
    assert seed_chunk(leg)["text"] == " Paris"
    texts = []
    for piece in [" Pa", "ris", " is", " big"]:  # D's own first token, split, then more
        out = cut_resent(leg, {"index": 0, "text": piece, "finish_reason": None})
        if out is not None:
            texts.append(out["text"])
    assert " Paris" + "".join(texts) == " Paris is big"
    plain = Leg(0, True, {"prompt": "x"})
    plain.on(LegEvent.PREFILL)
    plain.prefilled({"choices": [{"text": " Paris"}], "kv_transfer_params": {"lease_id": "L"}},
                    "http://p")
    assert not plain.resends  # kvrelay's own decode engine: token 1 is not sent again
