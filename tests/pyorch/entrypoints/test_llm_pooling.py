"""The offline pooling API (`LLM.embed`, `LLM.encode`, `LLM.score`) and its refusals: runner /
convert / pooler_config rules, matryoshka dimensions, generation on a pooling engine and pooling
on a generating one, and bad prompts that must leave the engine clean."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyorch import LLM, PoolingParams, SamplingParams
from pyorch.pooling_params import PoolerConfig
from pyorch.wire import decode_output, decode_params, encode_output, encode_params
from tests.pyorch.entrypoints.test_llm import _prompts, _tiny_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("pool_api")
    torch.manual_seed(0)
    config = _tiny_config("qwen3")
    config.matryoshka_dimensions = [32, 64]  # lets `dimensions` be tested
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


def _llm(path: str, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, dtype=torch.float32, max_model_len=128,
                kv_cache_memory_bytes=16 << 20, device="cpu")
    args.update(kwargs)
    return LLM(path, **args)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return _llm(model_dir, runner="pooling")


def _ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def test_embed_score_and_matryoshka(llm):
    prompts = _prompts(512, [3, 9, 30], seed=5)
    emb = llm.embed(_ids(prompts), use_tqdm=False)
    vectors = [np.asarray(e.outputs.embedding) for e in emb]
    assert all(v.shape == (128,) and abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
    # 1 -> N and N -> N pairing; the score of normalized vectors is their dot product.
    one_to_n = llm.score(_ids(prompts[:1]), _ids(prompts), use_tqdm=False)
    assert [round(s.outputs.score, 5) for s in one_to_n] == [
        round(float(vectors[0] @ v), 5) for v in vectors]
    assert one_to_n[1].prompt_token_ids == prompts[0] + prompts[1]
    n_to_n = llm.score(_ids(prompts[:2]), _ids(prompts[1:]), use_tqdm=False)
    assert abs(n_to_n[1].outputs.score - float(vectors[1] @ vectors[2])) < 1e-5
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(_ids(prompts[:2]), _ids(prompts), use_tqdm=False)
    # Matryoshka: the first 32 raw values, normalized again.
    raw = llm.embed(_ids(prompts[:1]), use_tqdm=False,
                    pooling_params=PoolingParams(normalize=False))[0].outputs.embedding
    small = llm.embed(_ids(prompts[:1]), use_tqdm=False,
                      pooling_params=PoolingParams(dimensions=32))[0].outputs.embedding
    want = np.asarray(raw[:32]) / np.linalg.norm(raw[:32])
    np.testing.assert_allclose(small, want, atol=1e-6)
    with pytest.raises(ValueError, match=r"only supports \[32, 64\] matryoshka"):
        llm.embed(_ids(prompts[:1]), use_tqdm=False, pooling_params=PoolingParams(dimensions=48))


def test_pooling_engine_refuses_generation_and_bad_prompts(llm):
    with pytest.raises(ValueError, match="only supported for generative models"):
        llm.generate(_ids([[5, 6]]), SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary|out of"):
        llm.embed(_ids([[5, 6], [10**6]]), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed(_ids([[5] * 129]), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling task"):
        PoolingParams(task="classify")
    # Nothing stayed queued or allocated, and the engine still serves (a full-length prompt:
    # pooling needs no room for an output token).
    sched = llm.llm_engine.scheduler
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_usable_blocks
    assert len(llm.embed(_ids([[5] * 128]), use_tqdm=False)[0].outputs.embedding) == 128


def test_runner_convert_and_pooler_config_rules(model_dir):
    gen = _llm(model_dir)
    with pytest.raises(ValueError, match="runner='pooling'"):
        gen.embed(_ids([[5, 6]]), use_tqdm=False)
    assert _llm(model_dir, convert="embed").llm_engine.config.model_config.is_pooling
    for kwargs, match in [
        (dict(runner="draft"), "draft models are not supported"),
        (dict(convert="classify"), "classification adapters are not supported"),
        (dict(runner="generate", convert="embed"), "needs runner='pooling'"),
        (dict(pooler_config={"pooling_type": "MEAN"}), "pooling models only"),
        (dict(runner="pooling", convert="none"), "does not support `--runner pooling`"),
        (dict(runner="pooling", pooler_config={"pooling_type": "STEP"}), "pooling_type"),
        (dict(runner="pooling", pooler_config={"logit_mean": 1.0}), "not supported by pyorch"),
        (dict(runner="pooling", pooler_config={"dimensions": 100}), "matryoshka"),
    ]:
        with pytest.raises(ValueError, match=match):
            _llm(model_dir, **kwargs)


def test_pooling_params_and_outputs_cross_the_wire():
    params = PoolingParams(task="token_embed", normalize=False, dimensions=8)
    assert decode_params(encode_params(params)) == params
    from pyorch.core_types import EngineCoreOutput

    pooled = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = decode_output(encode_output(EngineCoreOutput("r", [], "stop", pooled=pooled)))
    np.testing.assert_array_equal(out.pooled, pooled)
    assert out.finished and decode_output(encode_output(EngineCoreOutput("r", [1]))).pooled is None
    assert PoolerConfig(pooling_type="mean").pooling_type == "MEAN"
    with pytest.raises(ValueError, match="normalize"):
        PoolerConfig(normalize="yes")  # type: ignore[arg-type]


def test_all_pooling_refuses_embed_and_bert_is_refused_at_load(model_dir, tmp_path):
    llm = _llm(model_dir, runner="pooling", pooler_config={"pooling_type": "ALL"})
    out = llm.encode(_ids([[5, 6, 7]]), use_tqdm=False)[0]
    assert out.outputs.data.shape == (3, 128)
    with pytest.raises(ValueError, match="task 'embed'"):
        llm.embed(_ids([[5, 6, 7]]), use_tqdm=False)
    with pytest.raises(ValueError, match="task 'embed'"):
        llm.score(_ids([[5]]), _ids([[6]]), use_tqdm=False)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64)
    transformers.BertModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"encoder-only \(BERT-style\) models"):
        _llm(str(tmp_path), runner="pooling")
