"""Structured output through the official openai client against a real server (SmolLM2, CPU):
`chat.completions.parse` with a pydantic model, `response_format` json_object / json_schema,
`structured_outputs` and the older `guided_*` fields on both endpoints, streaming, and a 400
naming the field (with xgrammar's reason) for a bad schema, regex or grammar or for two
constraints at once."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import openai
import pytest
from conftest import MODEL_NAME
from pydantic import BaseModel, Field

jsonschema = pytest.importorskip("jsonschema")


class Pet(BaseModel):
    name: Annotated[str, Field(max_length=12)]
    species: Literal["cat", "dog", "fish"]
    age: Annotated[int, Field(ge=0, le=30)]
    vaccinated: bool


MESSAGES = [{"role": "user", "content": "Describe a pet as JSON with name, species, age."}]


def test_parse_with_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL_NAME, messages=MESSAGES, response_format=Pet, max_tokens=120,
        temperature=0.7, seed=1)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    pet = choice.message.parsed
    assert isinstance(pet, Pet)
    assert pet == Pet.model_validate_json(choice.message.content)


def test_response_format_json_object(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=150, temperature=0,
        response_format={"type": "json_object"})
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_response_format_text_is_plain(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
        response_format={"type": "text"})
    assert completion.choices[0].message.content


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["alpha", "beta", "gamma delta"]},
     lambda t: t in ("alpha", "beta", "gamma delta")),
    ({"guided_regex": r"[A-Z][a-z]{2,6} [0-9]{2}"},
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", t)),
    ({"guided_grammar": 'root ::= "x=" [0-9] [0-9]? ";"'},
     lambda t: re.fullmatch(r"x=[0-9][0-9]?;", t)),
    ({"guided_json": {"enum": ["on", "off"]}}, lambda t: json.loads(t) in ("on", "off")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"structured_outputs": {"regex": "(yes|no), [a-z]{3}", "disable_fallback": True}},
     lambda t: re.fullmatch("(yes|no), [a-z]{3}", t)),
])
def test_structured_fields_on_both_endpoints(client, extra, check):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60,
                                          temperature=0.8, seed=3, extra_body=extra)
    assert chat.choices[0].finish_reason == "stop"
    assert check(chat.choices[0].message.content), chat.choices[0].message.content
    completion = client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=60,
                                           temperature=0.8, seed=3, n=2, extra_body=extra)
    for c in completion.choices:
        assert c.finish_reason == "stop"
        assert check(c.text), c.text


SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                         "c": {"enum": ["x", "y"]}},
         "required": ["ok", "c"], "additionalProperties": False}


def test_streaming_structured_json(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0.5, seed=7,
        stream=True, extra_body={"structured_outputs": {"json": SMALL,
                                                        "disable_any_whitespace": True}})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    # No free whitespace: exactly xgrammar's (and json.dumps') ", " and ": " separators.
    assert json.dumps(json.loads(text)) == text
    jsonschema.validate(json.loads(text), SMALL)


def _bad(client, endpoint: str, extra: dict) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                           extra_body=extra)
        else:
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5,
                                      extra_body=extra)
    return info.value


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("extra,param,reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema.schema"),
    ({"guided_regex": "(a|b"}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "root ::= nothing_defined"}, "guided_grammar", "invalid grammar"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"json": {}, "surprise": 1}}, "structured_outputs", "surprise"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": '{"type": "structural_tag"}'}},
     "structured_outputs", "invalid structural tag"),
    ({"response_format": {"type": "structural_tag"}}, "response_format",
     "needs either `format` or `structures`"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "only one"),
])
def test_bad_constraints_are_400_naming_the_field(client, endpoint, extra, param, reason):
    error = _bad(client, endpoint, extra)
    assert error.status_code == 400
    body = error.body if isinstance(error.body, dict) else {}
    assert body.get("param") == param, body
    assert reason in body.get("message", ""), body


def test_server_still_serves_after_bad_constraints(client):
    _bad(client, "chat", {"guided_regex": "(unclosed"})
    ok = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10,
                                        temperature=0, extra_body={"guided_choice": ["fine"]})
    assert ok.choices[0].message.content == "fine"
