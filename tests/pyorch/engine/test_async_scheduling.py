"""Async scheduling (step N+1 scheduled and launched before step N's tokens are read) gives
exactly the outputs of the synchronous engine: stops by token id and EOS one step late on the
host, seeded sampling, max_tokens / max_model_len caps, penalties (which wait for the previous
token), aborts while a step is in flight, and no leaked blocks."""

from __future__ import annotations

import pytest
import torch

from pyorch import LLM, SamplingParams
from pyorch.engine.arg_utils import EngineArgs
from pyorch.engine.llm_engine import LLMEngine
from tests.conftest import CUDA_AVAILABLE

transformers = pytest.importorskip("transformers")

DTYPE = torch.bfloat16 if CUDA_AVAILABLE else torch.float32


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama_async")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _llm(path: str, async_scheduling: bool, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, dtype=DTYPE, max_model_len=256, seed=0,
                kv_cache_memory_bytes=16 << 20, gpu_memory_utilization=0.2,
                async_scheduling=async_scheduling)
    args.update(kwargs)
    return LLM(path, **args)


def _prompts(lens, seed=0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in lens]


def _run(path: str, async_scheduling: bool, prompts, params, **kwargs):
    llm = _llm(path, async_scheduling, **kwargs)
    assert llm.llm_engine.engine_core.async_scheduling is async_scheduling
    outs = llm.generate(prompts, params, use_tqdm=False)
    sched = llm.llm_engine.scheduler
    assert not sched.has_unfinished_requests()
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs]


def _same_both_ways(path, prompts, params, **kwargs):
    sync = _run(path, False, prompts, params, **kwargs)
    assert _run(path, True, prompts, params, **kwargs) == sync
    return sync


def test_stop_token_ids_and_eos(tiny_llama):
    prompts = _prompts([5, 17, 33, 2, 60])
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base = _run(tiny_llama, False, prompts, greedy)
    # Stop each request on a token it produces mid-way: the host learns it a step late.
    stops = sorted({toks[k] for toks, _, _ in base for k in (3, 7) if k < len(toks)})
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=stops)
    got = _same_both_ways(tiny_llama, prompts, params)
    assert any(reason == "stop" for _, reason, _ in got)
    for toks, reason, stop_reason in got:
        if reason == "stop":
            assert toks[-1] in stops and stop_reason == toks[-1]
    # EOS (id 2 in this config) where the model happens to produce it, else length.
    _same_both_ways(tiny_llama, prompts, SamplingParams(temperature=0.0, max_tokens=40))


def test_seeded_sampling_and_lengths(tiny_llama):
    prompts = _prompts([9, 31, 64, 1], seed=3)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=m, ignore_eos=True)
              for i, m in enumerate([1, 2, 13, 30])]
    got = _same_both_ways(tiny_llama, prompts, params)
    assert [len(t) for t, _, _ in got] == [1, 2, 13, 30]
    # max_model_len caps a long prompt's output: it must stop there, not one token later.
    capped = _same_both_ways(tiny_llama, _prompts([60]), SamplingParams(
        temperature=0.0, max_tokens=100, ignore_eos=True), max_model_len=70)
    assert len(capped[0][0]) == 10 and capped[0][1] == "length"


def test_penalties_and_min_tokens_wait_for_the_previous_token(tiny_llama):
    prompts = _prompts([12, 20, 7, 40], seed=5)
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, frequency_penalty=1.0,
                       presence_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, min_tokens=10),
    ]
    _same_both_ways(tiny_llama, prompts, params)


def test_chunked_prefill_and_preemption(tiny_llama):
    prompts = _prompts([40, 50, 60, 33, 45, 70], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    _same_both_ways(tiny_llama, prompts, params, max_num_batched_tokens=24,
                    num_gpu_blocks_override=13, max_model_len=128)


def test_abort_while_in_flight(tiny_llama):
    args = EngineArgs(model=tiny_llama, skip_tokenizer_init=True, dtype=DTYPE, max_model_len=256,
                      kv_cache_memory_bytes=16 << 20, gpu_memory_utilization=0.2,
                      async_scheduling=True)
    engine = LLMEngine.from_engine_args(args)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(_prompts([8, 16, 24], seed=11)):
        engine.add_request(str(i), p, params)
    finished = {}
    for step in range(200):
        if step == 3:
            engine.abort_request("1")  # its step is in flight: its token must be dropped
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert sorted(finished) == ["0", "2"]
    assert all(len(o.outputs[0].token_ids) == 12 for o in finished.values())
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    want = _run(tiny_llama, False, _prompts([8, 16, 24], seed=11), params)
    assert finished["0"].outputs[0].token_ids == want[0][0]
    assert finished["2"].outputs[0].token_ids == want[2][0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_timings_account_every_step(tiny_llama, async_scheduling):
    llm = _llm(tiny_llama, async_scheduling)
    core = llm.llm_engine.engine_core
    before = core.timings.snapshot()
    steps0 = core.num_steps
    llm.generate(_prompts([5, 9, 30]), SamplingParams(temperature=0.0, max_tokens=6,
                                                      ignore_eos=True), use_tqdm=False)
    phases = core.timings.per_step_ms(before)
    assert phases["steps"] == core.num_steps - steps0 > 0
    assert all(phases[k] >= 0.0 for k in core.timings.PHASES)
    assert phases["launch"] > 0.0 and phases["output"] > 0.0 and phases["schedule"] > 0.0
    assert phases["host"] == pytest.approx(sum(phases[k] for k in core.timings.PHASES
                                               if k != "wait"))
