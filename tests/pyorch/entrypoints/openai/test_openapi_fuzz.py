"""Schema fuzzing: schemathesis generates requests from the server's own OpenAPI schema (valid
and invalid ones); none may get a 5xx, and the engine must be alive afterwards."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

schemathesis = pytest.importorskip("schemathesis")

MAX_EXAMPLES = 60  # bounded: well under a minute on 2 CPU cores
# Generated bodies keep their shape and types, but numbers that only make the CPU engine work
# longer (not differently) are capped, so that the fuzz stays fast.
_CAPS = {"max_tokens": 3, "max_completion_tokens": 3, "n": 2, "min_tokens": 3}
_MAX_PROMPTS = 3


def _bound_cost(case) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    for key, cap in _CAPS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_completion_tokens"] = 3  # the default would fill the context
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[:_MAX_PROMPTS]


def test_fuzz_openapi_schema_no_server_errors(server):
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    strategy = (schema.as_strategy(GenerationMode.POSITIVE)
                | schema.as_strategy(GenerationMode.NEGATIVE))
    failures: list[str] = []
    seen: set[str] = set()

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case) -> None:
        seen.add(f"{case.method} {case.path}")
        _bound_cost(case)
        response = case.call(base_url=server.url, timeout=120)
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.path} {case.body!r} -> "
                            f"{response.status_code} {response.text[:300]}")

    check()
    assert not failures, "\n".join(failures)
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= seen
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": "Hello", "max_tokens": 2, "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
