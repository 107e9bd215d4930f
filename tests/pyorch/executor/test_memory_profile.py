"""The start-up memory profile (executor/memory_profile.py) on CPU, with torch.cuda's memory
counters stubbed by a fake allocator: the largest batch runs through the model and the sampler
over a throwaway KV cache, the peak comes back net of that cache, and the layers are unbound
after (GPU start-up sizes the KV cache from this figure)."""

from __future__ import annotations

import pytest
import torch

from pyorch.executor.memory_profile import profile_activation_peak
from pyorch.executor.model_runner import ModelRunner
from tests.pyorch.engine.test_async_llm import engine_args, make_tiny_model

pytest.importorskip("transformers")


def test_profile_activation_peak(tmp_path, monkeypatch):
    config = engine_args(make_tiny_model(tmp_path), skip_tokenizer_init=True,
                         max_num_batched_tokens=96, max_num_seqs=5).create_engine_config()
    runner = ModelRunner(config)
    runner.load_model()
    calls = {"forward": 0, "sample": 0}
    forward = runner.model.forward

    def counting_forward(input_ids, positions):
        calls["forward"] += 1
        assert input_ids.shape == positions.shape == (96,)
        # 96 tokens over 5 sequences: 20, 19, 19, 19, 19 positions from 0.
        assert positions.tolist()[:21] == list(range(20)) + [0]
        return forward(input_ids, positions)

    monkeypatch.setattr(runner.model, "forward", counting_forward)
    import pyorch.executor.memory_profile as mp

    real_sample_rows = mp.sample_rows

    def counting_sample_rows(sampler, logits, rows):
        calls["sample"] += 1
        assert logits.shape[0] == 5 and len(rows) == 5  # one row per sequence
        return real_sample_rows(sampler, logits, rows)

    monkeypatch.setattr(mp, "sample_rows", counting_sample_rows)
    allocated = iter([1000, 1000 + 4096])  # base (with the throwaway cache), then the peak
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(allocated))

    assert profile_activation_peak(runner) == 4096
    assert calls == {"forward": 1, "sample": 1}
    assert all(layer.kv_cache is None for layer in runner.attn_layers)
