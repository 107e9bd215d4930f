"""The pooling path end to end (runner="pooling") against transformers' `AutoModel` final hidden
states: tiny random Llama / Qwen3 in float32 on the CPU, LAST / MEAN / CLS / ALL pooling with and
without normalization, whole prompts and prompts split into chunks (chunked prefill), with
synchronous and async scheduling, and with preemptions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyorch import LLM, PoolingParams
from pyorch.layers.pooler import Pooler
from pyorch.pooling_params import PoolerConfig
from tests.pyorch.entrypoints.test_llm import _prompts, _tiny_config

transformers = pytest.importorskip("transformers")

PROMPT_LENS = [1, 7, 16, 17, 40, 83]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"pool_{request.param}")
    torch.manual_seed(0)
    config = _tiny_config(request.param)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    hf = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return str(path), hf, config


def _hidden(hf, prompt: list[int]) -> torch.Tensor:  # [len, hidden]
    with torch.no_grad():
        return hf(torch.tensor([prompt])).last_hidden_state[0].float()


def _reference(hidden: torch.Tensor, pooling_type: str, normalize: bool) -> torch.Tensor:
    pooled = {"LAST": lambda h: h[-1], "MEAN": lambda h: h.mean(0), "CLS": lambda h: h[0],
              "ALL": lambda h: h}[pooling_type](hidden)
    return F.normalize(pooled, dim=-1) if normalize else pooled


def _llm(path: str, **kwargs) -> LLM:
    args = dict(runner="pooling", skip_tokenizer_init=True, dtype=torch.float32,
                max_model_len=512, seed=0, kv_cache_memory_bytes=64 << 20, device="cpu")
    args.update(kwargs)
    return LLM(path, **args)


def _assert_pool_empty(llm: LLM) -> None:
    sched = llm.llm_engine.scheduler
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_usable_blocks
    assert not llm.llm_engine.model_runner._pooling


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS", "ALL"])
@pytest.mark.parametrize("mode", ["whole", "chunked16_async"])
def test_pooling_matches_transformers_hidden_states(tiny, pooling_type, normalize, mode):
    path, hf, config = tiny
    kwargs = {} if mode == "whole" else dict(max_num_batched_tokens=16, async_scheduling=True)
    llm = _llm(path, pooler_config={"pooling_type": pooling_type.lower(), "normalize": normalize},
               **kwargs)
    prompts = _prompts(config.vocab_size, PROMPT_LENS)
    outputs = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        want = _reference(_hidden(hf, prompt), pooling_type, normalize)
        assert out.finished and out.prompt_token_ids == prompt
        assert out.outputs.data.dtype == torch.float32
        torch.testing.assert_close(out.outputs.data, want, atol=2e-5, rtol=1e-4)
    _assert_pool_empty(llm)


def test_token_embed_task_and_per_request_normalize(tiny):
    """One LAST engine: encode(pooling_task="token_embed") gives every position's state, and a
    request's normalize=False overrides the config's default (True)."""
    path, hf, config = tiny
    llm = _llm(path)
    prompts = _prompts(config.vocab_size, [5, 23])
    ref = [_hidden(hf, p) for p in prompts]
    tokens = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False,
                        pooling_task="token_embed")
    for out, h in zip(tokens, ref, strict=True):
        torch.testing.assert_close(out.outputs.data, F.normalize(h, dim=-1), atol=2e-5,
                                   rtol=1e-4)
    raw = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False,
                    pooling_params=PoolingParams(normalize=False))
    for out, h in zip(raw, ref, strict=True):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), h[-1], atol=2e-5,
                                   rtol=1e-4)
        assert out.outputs.hidden_size == config.hidden_size


def test_preempted_pooling_requests_recompute_exactly(tiny):
    """A MEAN-pooled prompt preempted part-way through its chunks (the scheduler's own
    preemption, forced after the first step) is recomputed from scratch: the result still
    matches, and no block or runner state leaks."""
    path, hf, config = tiny
    llm = _llm(path, pooler_config={"pooling_type": "MEAN"}, max_num_batched_tokens=32)
    engine = llm.llm_engine
    prompts = _prompts(config.vocab_size, [83, 50], seed=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, PoolingParams())
    assert engine.step() == []  # 32 tokens of r0: nothing pooled yet
    sched = engine.scheduler
    victim = sched.running.pop(0)
    assert victim.request_id == "r0" and victim.num_computed_tokens == 32
    sched._preempt(victim)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert sched.num_preemptions == 1 and set(outputs) == {"r0", "r1"}
    for i, prompt in enumerate(prompts):
        want = _reference(_hidden(hf, prompt), "MEAN", True)
        torch.testing.assert_close(outputs[f"r{i}"].outputs.data, want, atol=2e-5, rtol=1e-4)
    _assert_pool_empty(llm)


def test_pooler_chunks_equal_whole_prompt():
    """Pooler.update over chunks = over the whole prompt, for every pooling type."""
    torch.manual_seed(0)
    hidden = torch.randn(29, 11)
    for kind in ("LAST", "MEAN", "CLS", "ALL"):
        pooler = Pooler(PoolerConfig(pooling_type=kind, normalize=False))
        params = PoolingParams(task="embed", normalize=False)
        whole = pooler.update(pooler.new_state(params, 29), hidden, 0)
        state = pooler.new_state(params, 29)
        parts = [pooler.update(state, hidden[a:b], a) for a, b in ((0, 5), (5, 16), (16, 29))]
        assert parts[0] is None and parts[1] is None
        torch.testing.assert_close(parts[2], whole)
        torch.testing.assert_close(whole, _reference(hidden, kind, False))
