"""Schema fuzzing: schemathesis generates requests from the server's own OpenAPI schema (valid
and invalid ones) for every route; then hostile strings (lone surrogates, huge sizes) go into
every text field of the routes that tokenize. None may get a 5xx, and the engine must be alive
afterwards."""

from __future__ import annotations

import json
from typing import Optional

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis")

MAX_EXAMPLES = 60  # bounded: well under a minute on 2 CPU cores
MAX_EXAMPLES_PER_ROUTE = 12  # every operation of the schema, on top of the mixed run
HOSTILE_EXAMPLES = 40
# Generated bodies keep their shape and types, but numbers that only make the CPU engine work
# longer (not differently) are capped, so that the fuzz stays fast.
_CAPS = {"max_tokens": 3, "max_completion_tokens": 3, "max_output_tokens": 3, "n": 2,
         "min_tokens": 3}
_MAX_PROMPTS = 3


def _bound_cost(case) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    for key, cap in _CAPS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if ("messages" in body and body.get("max_tokens") is None
            and body.get("max_completion_tokens") is None):
        # The default (also for an explicit null) would fill the context: 147 tokens of
        # SmolLM2 once took over the 120 s timeout on a loaded 2-core machine.
        body["max_completion_tokens"] = 3
    if "input" in body and isinstance(body.get("input"), (str, list)) \
            and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = 3  # /v1/responses
    for key in ("prompt", "input", "text_1", "text_2", "documents"):
        value = body.get(key)
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            body[key] = value[:_MAX_PROMPTS]


# The pooling routes: a generation server refuses them (400), a pooling server serves them.
_POOLING_OPS = {"POST /v1/embeddings", "POST /pooling", "POST /score", "POST /v1/score",
                "POST /rerank", "POST /v1/rerank"}


_RESPONSES_OPS = {"POST /v1/responses", "GET /v1/responses/{response_id}",
                  "POST /v1/responses/{response_id}/cancel"}


def test_fuzz_openapi_schema_no_server_errors(server):
    _fuzz_schema(server, {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
                          "POST /detokenize", "GET /health", "GET /v1/models",
                          "POST /invocations"} | _POOLING_OPS | _RESPONSES_OPS)
    _assert_alive(server.url)


def test_fuzz_openapi_schema_pooling_server_no_server_errors(pooling_server):
    _fuzz_schema(pooling_server, _POOLING_OPS | {"POST /v1/completions", "POST /tokenize",
                                                 "POST /invocations", "GET /tokenizer_info"})
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={"input": "Hello"}, timeout=120)
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) > 0


def test_fuzz_openapi_schema_responses_store_no_server_errors():
    """/v1/responses with the store on (PYORCH_ENABLE_RESPONSES_API_STORE), on the scripted
    engine: stored responses, previous_response_id, retrieve and cancel under fuzzed input."""
    from scripted_engine import ScriptedServer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYORCH_ENABLE_RESPONSES_API_STORE", "1")
        scripted = ScriptedServer("qwen2_5.jinja", enable_auto_tools=True,
                                  tool_call_parser="hermes", reasoning_parser="qwen3").start()
    try:
        scripted.engine.reply = "<think>Hm.</think>Fine."
        first = httpx.post(scripted.url + "/v1/responses", json={"input": "hi"}, timeout=60)
        assert first.status_code == 200, first.text
        _fuzz_schema(scripted, _RESPONSES_OPS, only=_RESPONSES_OPS)
        got = httpx.get(scripted.url + f"/v1/responses/{first.json()['id']}", timeout=60)
        assert got.status_code == 200 and got.json()["output"] == first.json()["output"]
    finally:
        scripted.stop()


def _fuzz_schema(server, required_ops: set[str], only: Optional[set[str]] = None) -> None:
    """Fuzzes every operation of the server's schema (or those in `only`)."""
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    strategy = (schema.as_strategy(GenerationMode.POSITIVE)
                | schema.as_strategy(GenerationMode.NEGATIVE))
    failures: list[str] = []
    seen: set[str] = set()
    calls = [0]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case) -> None:
        if only is not None and f"{case.method} {case.path}" not in only:
            return
        seen.add(f"{case.method} {case.path}")
        calls[0] += 1
        _bound_cost(case)
        response = case.call(base_url=server.url, timeout=120)
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.path} {case.body!r} -> "
                            f"{response.status_code} {response.text[:300]}")

    check()
    # Then each operation on its own, so that none is left to chance (/tokenize, /detokenize).
    for operation in schema.get_all_operations():
        op = operation.ok()
        if only is not None and f"{op.method.upper()} {op.path}" not in only:
            continue
        op_strategy = (op.as_strategy(generation_mode=GenerationMode.POSITIVE)
                       | op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        settings(max_examples=MAX_EXAMPLES_PER_ROUTE, deadline=None, database=None,
                 derandomize=True, phases=[Phase.generate],
                 suppress_health_check=list(HealthCheck))(given(case=op_strategy)(
                     check.hypothesis.inner_test))()
    assert not failures, "\n".join(failures)
    assert required_ops <= seen, seen
    print(f"\nschema fuzz: {len(seen)} operations, {calls[0]} cases, 0 responses 5xx")


def _assert_alive(url: str) -> None:
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(url + "/v1/completions",
                   json={"prompt": "Hello", "max_tokens": 2, "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- hostile strings in every text field ---------------------------------------------------------
_SIZES = (0, 1, 3, 100, 30_000, 3_000_000)  # 3 MB is over the length bound, under the body limit
_surrogate = st.integers(0xD800, 0xDFFF).map(chr)
_piece = st.one_of(st.characters(), _surrogate, st.sampled_from(["\x00", "\ufeff", "\U0010ffff",
                                                                 "<|im_start|>", "\\u", "\n"]))
_hostile_text = st.one_of(
    st.lists(_piece, max_size=20).map("".join),
    st.tuples(st.sampled_from(_SIZES), st.lists(_piece, min_size=1, max_size=3).map("".join))
    .map(lambda t: (t[1] * (t[0] // max(len(t[1]), 1) + 1))[: max(t[0], 1)]),
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]),
     "content": st.one_of(_hostile_text, st.lists(st.fixed_dictionaries(
         {"type": st.just("text"), "text": _hostile_text}), max_size=2))},
    optional={"name": _hostile_text})
_sampling = {"max_tokens": st.just(2), "stop": st.one_of(_hostile_text, st.lists(_hostile_text,
                                                                                  max_size=3)),
             "bad_words": st.lists(_hostile_text, max_size=2),
             "logit_bias": st.dictionaries(_hostile_text, st.floats(-5, 5), max_size=2)}
_hostile_requests = st.one_of(
    st.tuples(st.just("/v1/completions"), st.fixed_dictionaries(
        {"prompt": st.one_of(_hostile_text, st.lists(_hostile_text, min_size=1, max_size=3))},
        optional=_sampling)),
    st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
        {"messages": st.lists(_message, min_size=1, max_size=3),
         "max_completion_tokens": st.just(2)}, optional={k: v for k, v in _sampling.items()
                                                           if k != "max_tokens"})),
    st.tuples(st.just("/tokenize"), st.fixed_dictionaries({"prompt": _hostile_text})),
    st.tuples(st.just("/tokenize"), st.fixed_dictionaries(
        {"messages": st.lists(_message, min_size=1, max_size=3)},
        optional={"chat_template_kwargs": st.dictionaries(_hostile_text, _hostile_text,
                                                          max_size=2)})),
    st.tuples(st.just("/detokenize"), st.fixed_dictionaries(
        {"tokens": st.lists(st.integers(-2**70, 2**70), max_size=10)})),
    st.tuples(st.just("/v1/responses"), st.fixed_dictionaries(
        {"input": st.one_of(_hostile_text, st.lists(_message, min_size=1, max_size=3)),
         "max_output_tokens": st.just(2)},
        optional={"instructions": _hostile_text, "stop": _sampling["stop"]})),
)


_texts = st.one_of(_hostile_text, st.lists(_hostile_text, min_size=1, max_size=3))
_hostile_pooling_requests = st.one_of(
    st.tuples(st.sampled_from(["/v1/embeddings", "/pooling"]),
              st.fixed_dictionaries({"input": _texts},
                                    optional={"encoding_format": st.just("base64")})),
    st.tuples(st.sampled_from(["/score", "/v1/score"]),
              st.fixed_dictionaries({"text_1": _texts, "text_2": _texts})),
    st.tuples(st.sampled_from(["/rerank", "/v1/rerank"]), st.fixed_dictionaries(
        {"query": _hostile_text, "documents": st.lists(_hostile_text, min_size=1, max_size=3)})),
)


def test_fuzz_hostile_strings_no_server_errors(server):
    _fuzz_hostile(server, _hostile_requests)
    _assert_alive(server.url)


def test_fuzz_hostile_strings_pooling_server_no_server_errors(pooling_server):
    _fuzz_hostile(pooling_server, _hostile_pooling_requests)
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={"input": "Hello"}, timeout=120)
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) > 0


def _fuzz_hostile(server, requests) -> None:
    failures: list[str] = []
    count = [0]

    @settings(max_examples=HOSTILE_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(request=requests)
    def check(request: tuple[str, dict]) -> None:
        path, body = request
        count[0] += 1
        # json.dumps writes a lone surrogate as JSON's \ud800 escape, as a hostile client would.
        r = httpx.post(server.url + path, content=json.dumps(body),
                       headers={"content-type": "application/json"}, timeout=120)
        if r.status_code >= 500:
            failures.append(f"{path} {json.dumps(body)[:300]} -> {r.status_code} "
                            f"{r.text[:300]}")
        elif r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    check()
    assert not failures, "\n".join(failures)
    print(f"\nhostile-string fuzz: {count[0]} cases, 0 responses 5xx")
