"""SamplingParams: vLLM-compatible defaults, normalisation of stop fields, and the validation table.
Every invalid case must raise ValueError whose message names the offending field."""

import math

import pytest

from netra_jax.sampling_params import SamplingParams, SamplingType

VOCAB = 1000


def test_defaults_match_vllm():
    sp = SamplingParams()
    assert (sp.n, sp.max_tokens, sp.min_tokens, sp.temperature, sp.top_p, sp.top_k) == (1, 16, 0, 1.0, 1.0, 0)
    assert (sp.min_p, sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (0.0, 1.0, 0.0, 0.0)
    assert sp.logit_bias is None and sp.seed is None and sp.logprobs is None and sp.prompt_logprobs is None
    assert sp.stop == [] and sp.stop_token_ids == []
    assert sp.ignore_eos is False and sp.skip_special_tokens is True and sp.include_stop_str_in_output is False
    assert sp.validate(VOCAB) is sp


def test_stop_normalised_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_logit_bias_string_keys_from_json_become_ints():
    sp = SamplingParams(logit_bias={"12": 5.0, 7: -1.0}).validate(VOCAB)
    assert sp.logit_bias == {12: 5.0, 7: -1.0}
    with pytest.raises(ValueError, match="logit_bias token id 'abc'"):
        SamplingParams(logit_bias={"abc": 1.0}).validate(VOCAB)


def test_sampling_type_and_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    assert SamplingParams(temperature=0.7).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_valid_edge_values_pass():
    SamplingParams(
        n=128,
        max_tokens=None,
        min_tokens=5,
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        repetition_penalty=0.01,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        logit_bias={0: -100.0, VOCAB - 1: 100},
        seed=-5,
        stop=["x"] * 16,
        stop_token_ids=[0, VOCAB - 1],
        logprobs=20,
        prompt_logprobs=0,
    ).validate(VOCAB)
    SamplingParams(max_tokens=4, min_tokens=4).validate(VOCAB)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 0}, "n must be"),
        ({"n": 129}, "n must be"),
        ({"n": 1.5}, "n must be"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens .* must not exceed max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias token id 1000 is outside"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id -1 is outside"),
        ({"logit_bias": {5: 100.5}}, "logit_bias value for token 5"),
        ({"logit_bias": {5: math.nan}}, "logit_bias value for token 5"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a mapping"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids entry 1000"),
        ({"stop_token_ids": [-1]}, "stop_token_ids entry -1"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids entry 'a'"),
        ({"logprobs": -1}, "logprobs must be"),
        ({"logprobs": 21}, "logprobs must be"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be"),
        ({"stop": ["s"] * 17}, "at most 16 stop strings"),
        ({"stop": ""}, "stop strings must not be empty"),
        ({"stop": ["ok", ""]}, "stop strings must not be empty"),
        ({"stop": [3]}, "stop must be a string or a list of strings"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"ignore_eos": "yes"}, "ignore_eos must be a bool"),
    ],
)
def test_invalid_params_raise_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs).validate(VOCAB)


def test_max_logprobs_is_configurable():
    SamplingParams(logprobs=50).validate(VOCAB, max_logprobs=64)
    with pytest.raises(ValueError, match="logprobs must be at most the engine's max_logprobs of 5"):
        SamplingParams(logprobs=6).validate(VOCAB, max_logprobs=5)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 5\]"):
        SamplingParams(prompt_logprobs=-1).validate(VOCAB, max_logprobs=5)


def test_bad_vocab_size_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingParams().validate(0)


def test_clone_copies_containers():
    a = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={2: 1.0}, seed=1)
    b = a.clone(seed=2)
    b.stop.append("y")
    b.stop_token_ids.append(3)
    b.logit_bias[4] = 0.5
    assert a.stop == ["x"] and a.stop_token_ids == [1] and a.logit_bias == {2: 1.0}
    assert (a.seed, b.seed) == (1, 2)
