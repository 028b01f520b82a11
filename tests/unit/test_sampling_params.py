import pytest

from kvrelay.sampling_params import InvalidParameter, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**63}, "top_k"),  # issue 21: failed the whole batch's model step
        ({"min_p": 1.2}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_out_of_range_names_the_field(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert err.value.param == param
    assert param in str(err.value)


def test_stop_string_becomes_a_tuple() -> None:
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(temperature=0).greedy
