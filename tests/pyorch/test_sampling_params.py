"""SamplingParams: defaults, normalization and the ValueErrors of validation."""

import pytest

from pyorch.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.bad_words == []
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.seed is None and p.logit_bias is None and p.allowed_token_ids is None
    assert p.all_stop_token_ids == set()
    assert p.sampling_type == SamplingType.RANDOM


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=0), "n must be"),
        (dict(n=1.5), "n must be"),
        (dict(temperature=-0.1), "temperature must be non-negative"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be"),
        (dict(top_k=2.5), "top_k must be"),
        (dict(min_p=-0.01), r"min_p must be in \[0, 1\]"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(presence_penalty=-2.1), "presence_penalty"),
        (dict(frequency_penalty=-3.0), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(min_tokens=-1), "min_tokens must be >= 0"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens must be <= max_tokens=5"),
        (dict(logprobs=-2), "logprobs must be non-negative or -1"),
        (dict(prompt_logprobs=-5), "prompt_logprobs must be non-negative or -1"),
        (dict(stop=5), "stop must be a string or a list"),
        (dict(stop=["ok", 3]), "stop must contain only strings"),
        (dict(stop=["ok", ""]), "empty string"),
        (dict(stop="x", detokenize=False), "detokenize=True"),
        (dict(stop_token_ids=[1, "2"]), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(seed=1.5), "seed must be an integer"),
        (dict(allowed_token_ids=[]), "allowed_token_ids is not None and empty"),
        (dict(allowed_token_ids=[1, -3]), "allowed_token_ids"),
        (dict(logit_bias={"a": 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(temperature="hot"), "temperature must be a number"),
    ],
)
def test_invalid_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_accepted_edges():
    SamplingParams(top_k=-1)
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(min_tokens=16, max_tokens=16)
    SamplingParams(logprobs=-1, prompt_logprobs=0)
    SamplingParams(max_tokens=None, min_tokens=100)


def test_normalization():
    p = SamplingParams(stop="###", seed=-1, logprobs=True, logit_bias={"5": 300, 7: -1e9})
    assert p.stop == ["###"]
    assert p.seed is None
    assert p.logprobs == 1
    assert p.logit_bias == {5: 100.0, 7: -100.0}


def test_greedy_resets_truncation_and_small_temperature_is_raised():
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2, seed=3)
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)
    assert p.sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-3).temperature == pytest.approx(1e-2)
    assert SamplingParams(seed=7).sampling_type == SamplingType.RANDOM_SEED


def test_all_stop_token_ids_and_generation_config():
    p = SamplingParams(stop_token_ids=[5])
    p.update_from_generation_config({"eos_token_id": [2, 9]}, model_eos_token_id=2)
    assert p.all_stop_token_ids == {2, 5, 9}
    assert sorted(p.stop_token_ids) == [5, 9]
    q = SamplingParams(stop_token_ids=[5], ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": 9}, model_eos_token_id=2)
    assert q.all_stop_token_ids == {5} and q.stop_token_ids == [5]


def test_validate_token_ids():
    p = SamplingParams(allowed_token_ids=[1, 2], logit_bias={3: 1.0}, stop_token_ids=[4])
    p.validate_token_ids(vocab_size=5)
    for kwargs in (dict(allowed_token_ids=[5]), dict(logit_bias={9: 1}), dict(stop_token_ids=[5])):
        with pytest.raises(ValueError, match="out-of-vocab"):
            SamplingParams(**kwargs).validate_token_ids(vocab_size=5)


class _WordTokenizer:
    """Encodes each character as its code point; a leading space becomes its own token 32."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_bad_words_token_ids():
    p = SamplingParams(bad_words=["ab", " c"])
    assert p.bad_words_token_ids is None
    p.update_from_tokenizer(_WordTokenizer())
    # " ab" has a different length from "ab", so it is not a second variant.
    assert p.bad_words_token_ids == [[97, 98], [99]]


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    p.update_from_generation_config({}, model_eos_token_id=3)
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[2] = 1.0
    q.all_stop_token_ids.add(9)
    assert p.stop == ["a"] and p.logit_bias == {1: 2.0} and p.all_stop_token_ids == {3}
    assert q.all_stop_token_ids == {3, 9}


def test_clone_equals_deepcopy():
    """clone() copies the usual field types by hand: the result is what copy.deepcopy gives,
    with no container shared with the original."""
    import copy

    p = SamplingParams(n=2, stop=["a", "b"], stop_token_ids=[5, 6], bad_words=["x"],
                       logit_bias={1: 2.0}, allowed_token_ids=[1, 2, 3], seed=4, logprobs=2,
                       output_kind=RequestOutputKind.DELTA)
    p.update_from_generation_config({"eos_token_id": [7, 8]}, model_eos_token_id=7)
    p.update_from_tokenizer(_WordTokenizer())
    p.extra = {"nested": [[1], {"k": (2, 3)}]}  # an attribute of no usual type
    q = p.clone()
    assert vars(q) == vars(copy.deepcopy(p))
    for name, value in vars(p).items():
        if isinstance(value, (list, set, dict)):
            assert getattr(q, name) is not value, name
    assert q.bad_words_token_ids[0] is not p.bad_words_token_ids[0]
    assert q.extra["nested"][1] is not p.extra["nested"][1]
