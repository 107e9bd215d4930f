"""Engine shutdown frees the device: the in-process executor drops the model, the KV cache and
the CUDA graphs (UniProcExecutor.shutdown -> ModelRunner.release). An engine dropped without
shutdown should be collected before the next one loads and sizes its KV cache from free memory;
on the GPU it is not yet (a strict xfail records it)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pyorch.entrypoints.llm import LLM
from pyorch.sampling_params import SamplingParams
from tests.pyorch.engine.test_async_llm import make_tiny_model

pytest.importorskip("transformers")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_shutdown_releases_model_and_cache(tmp_path, device):
    llm = LLM(make_tiny_model(tmp_path), device=device, skip_tokenizer_init=True,
              gpu_memory_utilization=0.3)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    runner = llm.llm_engine.engine_core.model_runner
    model_ref = weakref.ref(runner.model)
    cache_ref = weakref.ref(runner.kv_caches[0][0])
    llm.llm_engine.shutdown()
    gc.collect()
    assert model_ref() is None and cache_ref() is None
    assert runner.model is None and runner.kv_caches == [] and runner.cuda_graphs is None
    llm.llm_engine.shutdown()  # idempotent


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.xfail(strict=True, reason=(
    "known bug, not diagnosed: an LLM dropped without shutdown() keeps its weights and KV cache "
    "on the GPU even after gc.collect() (the H100 run found 46.8 GiB still allocated when the "
    "second engine loaded), so something outside the cycle still references it"))
def test_engine_dropped_without_shutdown_is_collected_before_the_next_loads(tmp_path):
    path = make_tiny_model(tmp_path)
    # Each engine sizes its KV cache to 60% of the GPU: without the collection before loading,
    # the second one would find no memory left.
    for _ in range(3):
        llm = LLM(path, device="cuda", skip_tokenizer_init=True, gpu_memory_utilization=0.6)
        llm._cycle = llm  # type: ignore[attr-defined]  # a cycle: only the collector frees it
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
        del llm
