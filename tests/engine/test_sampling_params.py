"""SamplingParams validation: out-of-range values raise ``SamplingParamsError`` (a ValueError
naming the parameter), normalisation, and the checks against the model's vocabulary."""

from __future__ import annotations

import math

import pytest

from trillm.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ],
)
def test_sampling_params_rejects_out_of_range_values(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)
    assert isinstance(info.value, ValueError)


def test_sampling_params_vocab_checks_and_normalisation():
    params = SamplingParams(top_k=-1, stop="x", logit_bias={"3": 1}, temperature=0.0, top_p=0.5)
    assert params.top_k == 0 and params.stop == ["x"] and params.logit_bias == {3: 1.0}
    assert params.greedy and params.top_p == 1.0
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(allowed_token_ids=[5, 10]).verify_vocab(vocab_size=10, max_logprobs=20)
    assert info.value.param == "allowed_token_ids"
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(logprobs=21).verify_vocab(vocab_size=10, max_logprobs=20)
    assert info.value.param == "logprobs"
    SamplingParams(logprobs=20, stop_token_ids=[9]).verify_vocab(vocab_size=10, max_logprobs=20)


def test_minus_one_logprobs_is_the_whole_vocabulary_under_max_logprobs():
    """vLLM's rule: -1 asks for the whole vocabulary, allowed when it fits max_logprobs
    (whose own -1 is no cap but the vocabulary)."""
    params = SamplingParams(logprobs=-1, prompt_logprobs=-1)
    params.verify_vocab(vocab_size=10, max_logprobs=10)
    assert (params.logprobs, params.prompt_logprobs) == (10, 10)
    SamplingParams(prompt_logprobs=10).verify_vocab(vocab_size=10, max_logprobs=-1)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs=10, more than") as info:
        SamplingParams(prompt_logprobs=-1).verify_vocab(vocab_size=10, max_logprobs=9)
    assert info.value.param == "prompt_logprobs"


def test_sampling_params_rejects_non_integer_logit_bias_keys():
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(logit_bias={"abc": 1.0})
    assert info.value.param == "logit_bias"
