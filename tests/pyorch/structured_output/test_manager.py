"""Structured output through the whole engine (offline `LLM`, tiny random-weight Llama with
SmolLM2's tokenizer and a logits width past the tokenizer's vocabulary): every kind of
constraint holds on sampled text, sync and async scheduling agree, a compiling grammar holds up
only its own request, bad constraints raise before anything is queued, and no blocks leak."""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import pytest
import torch

from pyorch import LLM, SamplingParams
from pyorch.sampling_params import StructuredOutputsParams
from tests.pyorch.engine.test_async_llm import make_tiny_model

transformers = pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

PAD = 40  # logits wider than the tokenizer: these ids must never be sampled under a constraint
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    from pyorch.model_loader import default_model_path, get_tokenizer

    return get_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tokenizer) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_so"), len(tokenizer) + PAD, tokenizer)


def _llm(path: str, async_scheduling: bool = False, **kwargs) -> LLM:
    args = dict(dtype=torch.float32, max_model_len=512, seed=0, device="cpu",
                kv_cache_memory_bytes=16 << 20, async_scheduling=async_scheduling)
    args.update(kwargs)
    return LLM(path, **args)


def _assert_pool_empty(llm: LLM) -> None:
    sched = llm.llm_engine.scheduler
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_usable_blocks


def _params(seed: int, logit_bias: dict | None = None, **constraint) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=200, logit_bias=logit_bias,
                          structured_outputs=StructuredOutputsParams(
                              disable_any_whitespace="json" in constraint
                              or "json_object" in constraint, **constraint))


CASES = [
    ("json", dict(json=SCHEMA)),
    ("json_object", dict(json_object=True)),
    ("regex", dict(regex=r"[a-z]{2,8}@[a-z]{2,5}\.(com|org)")),
    ("choice", dict(choice=["red", "green", "blue light", 'say "x"'])),
    ("grammar", dict(grammar='root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?')),
]


def _check(kind: str, constraint: dict, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(constraint["regex"], text), text
    elif kind == "choice":
        assert text in constraint["choice"]
    else:
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", text), text


def _closing_bias(tokenizer) -> dict[int, float]:
    """Random weights never end a free JSON string on their own: favour closing quotes and
    braces (the grammar still decides what is allowed)."""
    ids = {tokenizer.encode(s, add_special_tokens=False)[0] for s in ('"', "}", '",', "]")}
    return {**{i: 30.0 for i in ids}, tokenizer.eos_token_id: 40.0}


def _generate(llm: LLM, seeds: range) -> list[tuple[str, dict, list[int], str, str]]:
    prompts, params, meta = [], [], []
    tokenizer = llm.get_tokenizer()
    # Padding ids get a bias no real token can beat: only the mask keeps them out.
    pad_bias = {i: 50.0 for i in range(len(tokenizer), len(tokenizer) + PAD)}
    closing = {**pad_bias, **_closing_bias(tokenizer)}
    for seed in seeds:
        for kind, constraint in CASES:
            prompts.append(f"Write {kind} number {seed}:")
            params.append(_params(seed, closing if kind == "json_object" else pad_bias,
                                  **constraint))
            meta.append((kind, constraint))
        prompts.append(f"Free text {seed}:")  # unconstrained batchmate: takes padding ids
        params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=20, ignore_eos=True,
                                     logit_bias=pad_bias))
        meta.append(("free", {}))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(kind, c, list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
            for (kind, c), o in zip(meta, outs, strict=True)]


def test_every_constraint_holds_sync_and_async(model_path, tokenizer):
    llm = _llm(model_path, async_scheduling=False)
    results = _generate(llm, range(3))
    padded_seen = False
    for kind, constraint, token_ids, text, finish_reason in results:
        if kind == "free":
            padded_seen |= any(t >= len(tokenizer) for t in token_ids)
            continue
        assert finish_reason == "stop", (kind, text)
        assert all(t < len(tokenizer) for t in token_ids), (kind, token_ids)
        _check(kind, constraint, text)
    assert padded_seen, "the biased padding ids win wherever nothing masks them"
    _assert_pool_empty(llm)
    # Async scheduling: a constrained batch waits for the previous step's tokens before its
    # bitmask is filled, so the tokens are the synchronous engine's.
    llm = _llm(model_path, async_scheduling=True)
    assert llm.llm_engine.engine_core.async_scheduling
    assert _generate(llm, range(3)) == results
    _assert_pool_empty(llm)


def test_n_and_greedy_and_preemption(model_path):
    # A tiny KV cache forces preemptions (recompute keeps the matcher's state); n=3 fans out
    # into three matchers of one compiled grammar.
    llm = _llm(model_path, kv_cache_memory_bytes=19 << 15, max_model_len=256,
               reserve_kv_for_growth=False)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=150,
                            structured_outputs=StructuredOutputsParams(
                                json=SCHEMA, disable_any_whitespace=True))
    greedy = SamplingParams(temperature=0.0, max_tokens=150,
                            structured_outputs=StructuredOutputsParams(regex=r"(ab|cd){5,30}"))
    outs = llm.generate(["a" * 40] * 3 + ["b" * 40], [params] * 3 + [greedy], use_tqdm=False)
    for out in outs[:3]:
        assert len(out.outputs) == 3
        for c in out.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert re.fullmatch(r"(ab|cd){5,30}", outs[3].outputs[0].text)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_pool_empty(llm)


@pytest.mark.parametrize("params,reason", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "JSON schema"),
    (dict(regex="(unclosed"), "invalid regex"),
    (dict(grammar="root ::= missing"), "invalid grammar"),
])
def test_bad_constraint_raises_and_engine_goes_on(model_path, params, reason):
    llm = _llm(model_path)
    bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(**params))
    with pytest.raises(ValueError, match=reason):
        llm.generate(["x"], bad, use_tqdm=False)
    out = llm.generate(["x"], _params(0, choice=["fine"]), use_tqdm=False)[0]
    assert out.outputs[0].text == "fine"
    _assert_pool_empty(llm)


def test_no_tokenizer_is_refused(model_path):
    llm = _llm(model_path, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate([[5, 6, 7]], _params(0, choice=["a"]), use_tqdm=False)


def test_compiling_grammar_holds_up_only_its_request(model_path):
    """vLLM's WAITING_FOR_FSM: a request whose grammar is compiling is not scheduled; the
    others run to completion meanwhile; it runs once the grammar is ready."""
    llm = _llm(model_path)
    engine = llm.llm_engine
    manager = engine.engine_core.structured_output_manager
    gate = threading.Event()
    compile_real = manager._compile

    def slow_compile(spec):
        assert gate.wait(60)
        return compile_real(spec)

    manager._compile = slow_compile
    engine.add_request("slow", "abc", _params(0, regex="[0-9]{4}"))
    engine.add_request("plain", "abc", SamplingParams(max_tokens=8, ignore_eos=True))
    finished = {}
    deadline = time.monotonic() + 60
    while "plain" not in finished:
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    slow = engine.scheduler.requests["slow"]
    assert slow.num_computed_tokens == 0 and not slow.output_token_ids
    gate.set()
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert re.fullmatch("[0-9]{4}", finished["slow"].outputs[0].text)
    assert len(finished["plain"].outputs[0].token_ids) == 8
    _assert_pool_empty(llm)


def test_compile_failure_in_core_aborts_only_that_request(model_path):
    llm = _llm(model_path)
    engine = llm.llm_engine
    manager = engine.engine_core.structured_output_manager

    def broken(spec):
        raise RuntimeError("compiler exploded")

    manager._compile = broken
    engine.add_request("bad", "abc", _params(0, regex="[0-9]{4}"))
    engine.add_request("plain", "abc", SamplingParams(max_tokens=4, ignore_eos=True))
    finished = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].outputs[0].finish_reason == "abort"
    assert len(finished["plain"].outputs[0].token_ids) == 4
    _assert_pool_empty(llm)


def test_compiled_grammars_are_cached_and_bounded(tokenizer, monkeypatch):
    """One compile per spec (n > 1 children and repeated schemas share it); the cache keeps the
    most recently used GRAMMAR_CACHE_SIZE specs."""
    from pyorch.core.request import Request
    from pyorch.structured_output import manager as manager_mod

    monkeypatch.setattr(manager_mod, "GRAMMAR_CACHE_SIZE", 3)
    manager = manager_mod.StructuredOutputManager(lambda: tokenizer, len(tokenizer))
    compiled = []
    compile_real = manager._compile
    manager._compile = lambda spec: compiled.append(spec) or compile_real(spec)

    def ready(regex: str) -> Request:
        request = Request(regex, [1], _params(0, regex=regex), tokenizer.eos_token_id, 0.0)
        manager.grammar_init(request)
        deadline = time.monotonic() + 60
        while not request.structured_output_request.is_ready:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert request.structured_output_request.error is None
        return request

    first, again = ready("a+"), ready("a+")
    assert len(compiled) == 1
    assert first.structured_output_request.grammar is not again.structured_output_request.grammar
    for regex in ("b+", "c+", "d+"):
        ready(regex)
    assert len(manager._cache) == 3 and "a+" not in [s.text for s in manager._cache]
    ready("a+")  # dropped, so compiled again
    assert len(compiled) == 5
    manager.shutdown()


@pytest.mark.parametrize("num_rows", [3, 40])
def test_accept_sampled_batched_equals_one_by_one(tokenizer, num_rows):
    """accept_sampled (xgrammar's batch accept past 16 one-token rows) leaves every matcher
    where accepting one request at a time does, counts processed tokens, handles several
    tokens and terminated grammars, and logs a rejected token without raising."""
    from pyorch.structured_output.backend_xgrammar import XgrammarBackend, grammar_spec
    from pyorch.structured_output.manager import StructuredOutputRequest, accept_sampled

    backend = XgrammarBackend(tokenizer, len(tokenizer) + PAD)
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    compiled = backend.compile(grammar_spec(params))
    text = '{"name": "ab", "age": 7, "tags": ["a"], "ok": true}'
    ids = tokenizer.encode(text, add_special_tokens=False)

    def fresh() -> StructuredOutputRequest:
        r = StructuredOutputRequest(params, grammar_spec(params))
        r.grammar = backend.new_grammar(compiled)
        return r

    batched = [fresh() for _ in range(num_rows)]
    serial = [fresh() for _ in range(num_rows)]
    for step, token in enumerate(ids):
        pending = [(f"r{i}", r, [token]) for i, r in enumerate(batched)]
        if step == 0:  # one row takes two tokens at once
            pending[0] = ("r0", batched[0], ids[:2])
        elif step == 1:
            pending = pending[1:]
        accept_sampled(pending)
        for r in serial:
            r.accept_tokens("s", [token])
    bitmask = np.zeros((2, backend.num_words), dtype=np.int32)
    for b, s in zip(batched, serial, strict=True):
        assert b.grammar.num_processed_tokens == s.grammar.num_processed_tokens == len(ids)
        b.grammar.fill_bitmask(bitmask, 0)
        s.grammar.fill_bitmask(bitmask, 1)
        assert (bitmask[0] == bitmask[1]).all()
    # A token the grammar refuses: logged, the matcher unchanged.
    bad = [(f"r{i}", fresh(), [tokenizer.encode("x", add_special_tokens=False)[0]])
           for i in range(num_rows)]
    accept_sampled(bad)
    assert all(r.grammar.num_processed_tokens == 0 for _, r, _ in bad)
