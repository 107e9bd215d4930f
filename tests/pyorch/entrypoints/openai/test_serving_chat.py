"""POST /v1/chat/completions through the official openai client, against a real server."""

from __future__ import annotations

import json

import openai
import pytest

from conftest import MODEL_NAME

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a color."}]


def chat(client, messages=MESSAGES, max_tokens=6, **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                          max_tokens=max_tokens, temperature=0, **kw)


@pytest.fixture(scope="module")
def reference(client):
    return chat(client)


def test_chat_shape_and_usage(reference, http):
    assert reference.object == "chat.completion" and reference.id.startswith("chatcmpl-")
    (choice,) = reference.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = reference.usage
    templated = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert usage.prompt_tokens == templated  # the chat template, then tokenization
    assert usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_streaming(client, reference):
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"  # the first delta carries the role
    content = [c for c in chunks if c.choices]
    assert all(c.choices[0].delta.role is None for c in content[1:])
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == reference.choices[0].message.content
    assert [c.choices[0].finish_reason for c in content].count(None) == len(content) - 1
    assert content[-1].choices[0].finish_reason == reference.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == reference.usage


def test_chat_stream_wire_format(http):
    body = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0, "stream": True, "n": 2}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    roles = [p["choices"][0]["index"] for p in payloads if "role" in p["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1]
    finished = [p["choices"][0]["index"] for p in payloads if p["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_chat_n_seed_and_max_completion_tokens(client):
    def sample(seed):
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Write a random word."}],
            n=2, temperature=1.5, seed=seed, max_completion_tokens=4)
        assert [c.index for c in out.choices] == [0, 1]
        assert all(c.finish_reason in ("stop", "length") for c in out.choices)
        assert out.usage.completion_tokens <= 8
        return [c.message.content for c in out.choices]

    first = sample(42)
    assert sample(42) == first  # same seed, same samples
    assert first[0] != first[1]  # the two samples differ (each child gets seed + index)


def test_chat_stop_string(client, reference):
    text = reference.choices[0].message.content
    words = text.split()
    assert len(words) >= 3, text
    stop = words[1]  # inside the output: one that ends it would tie with max_tokens
    out = chat(client, stop=stop).choices[0]
    assert out.finish_reason == "stop"
    assert out.message.content == text[: text.index(stop)]


def test_chat_logprobs(client):
    out = chat(client, max_tokens=5, logprobs=True, top_logprobs=2).choices[0]
    content = out.logprobs.content
    assert len(content) == 5 or out.finish_reason == "stop"
    assert "".join(t.token for t in content) == out.message.content
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_continue_final_message(client):
    messages = [{"role": "user", "content": "Count to five."},
                {"role": "assistant", "content": "1, 2, 3,"}]
    out = chat(client, messages, max_tokens=4,
               extra_body={"add_generation_prompt": False, "continue_final_message": True,
                           "echo": True})
    assert out.choices[0].message.content.startswith("1, 2, 3,")
    assert len(out.choices[0].message.content) > len("1, 2, 3,")


def test_content_parts(client, reference):
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
             {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    assert chat(client, parts).choices[0].message.content == reference.choices[0].message.content


@pytest.mark.parametrize("body, fragment", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": MESSAGES, "top_logprobs": 3}, "logprobs"),
    ({"messages": MESSAGES, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ({"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True},
     "assistant"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "text content"),
    ({"messages": MESSAGES, "max_completion_tokens": 10**6}, "maximum context length"),
    ({"messages": MESSAGES, "n": 1000}, "n"),
])
def test_chat_invalid_requests_are_400(http, body, fragment):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_chat_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES, max_tokens=1)
    assert info.value.status_code == 404
    assert info.value.body["type"] == "NotFoundError"  # type: ignore[index]
    assert "gpt-17" in info.value.body["message"]  # type: ignore[index]
