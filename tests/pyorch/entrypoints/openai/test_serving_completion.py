"""POST /v1/completions through the official openai client, against a real server."""

from __future__ import annotations

import json

import openai
import pytest

from conftest import MODEL_NAME

PROMPT = "The capital of France is"


def greedy(client, prompt=PROMPT, max_tokens=8, **kw):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, **kw)


def test_completion_greedy_usage_and_shape(client):
    out = greedy(client)
    assert out.object == "text_completion" and out.model == MODEL_NAME
    assert out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert choice.index == 0 and choice.text.strip()
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == 5
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == 13


def test_completion_model_may_be_omitted(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["model"] == MODEL_NAME


def test_streaming_equals_non_streaming(client):
    expected = greedy(client).choices[0].text
    chunks = list(greedy(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done(http):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert "usage" not in payloads[-1]  # no include_usage: no usage chunk


def test_stop_string_cuts_the_output(client):
    full = greedy(client).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    out = greedy(client, stop=[stop, "never-appears"]).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    assert stop not in out.text
    assert out.model_extra["stop_reason"] == stop


def test_n_samples_and_seeded_reproducibility(client):
    def sample(seed):
        out = client.completions.create(model=MODEL_NAME, prompt="My favorite word is", n=3,
                                        max_tokens=5, temperature=1.5, seed=seed,
                                        extra_body={"ignore_eos": True})
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert out.usage.completion_tokens == 15
        return [c.text for c in out.choices]

    first = sample(1234)
    assert sample(1234) == first  # same seed, same samples
    assert len(set(first)) > 1  # the n samples differ (each child gets seed + index)
    assert sample(4321) != first


def test_logprobs(client):
    out = greedy(client, max_tokens=6, logprobs=3).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        assert 1 <= len(top) <= 4 and token in top
        assert top[token] == pytest.approx(max(top.values()))  # greedy took the top token


def test_echo_with_logprobs(client):
    out = greedy(client, max_tokens=4, echo=True, logprobs=1).choices[0]
    assert out.text.startswith(PROMPT)
    lp = out.logprobs
    assert len(lp.tokens) == 5 + 4  # prompt tokens, then generated ones
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # first prompt token
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == out.text


def test_prompt_forms_and_choice_order(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = greedy(client, max_tokens=4).choices[0].text
    assert greedy(client, prompt=ids, max_tokens=4).choices[0].text == by_text
    out = greedy(client, prompt=[PROMPT, "1, 2, 3,"], max_tokens=4, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]  # prompt i, sample j -> i * n + j
    assert out.choices[0].text == out.choices[1].text == by_text
    assert out.choices[2].text == out.choices[3].text != by_text
    batch = greedy(client, prompt=[ids, ids], max_tokens=4)
    assert [c.text for c in batch.choices] == [by_text, by_text]
    assert batch.usage.prompt_tokens == 2 * len(ids)


def test_sampling_knobs_are_accepted(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0.7, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"13": -100}, seed=7, user="u1",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 6,
                    "ignore_eos": True})
    assert out.usage.completion_tokens == 6


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "top_p": 2}, "top_p"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "logprobs": 50}, "logprobs"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": PROMPT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": PROMPT, "stop": [""]}, "stop"),
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "empty"),
    ({"prompt": [1, 2, 10**9]}, "out of range"),
    ({"prompt": [[1, 2], [-3]]}, "out of range"),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": PROMPT, "seed": 2**70}, "seed"),
])
def test_invalid_parameters_are_400(http, body, fragment):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert fragment in error["message"]


def test_too_long_prompts_are_400(client, http):
    long_ids = [1] * 300  # max_model_len is 256
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=long_ids, max_tokens=1)
    assert "maximum context length is 256" in str(info.value)
    r = http.post("/v1/completions", json={"prompt": [1] * 250, "max_tokens": 10})
    assert r.status_code == 400 and "260 tokens" in r.json()["error"]["message"]
