"""Tiny random-weight models for the benchmark tests (CPU, float32, seconds to run)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

# Small enough that a generate of a few tokens takes milliseconds on 2 cores.
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)

# Flags every engine in these tests takes: no tokenizer in the folders, a small KV budget.
ENGINE_FLAGS = ["--device", "cpu", "--skip-tokenizer-init", "--dtype", "float32",
                "--max-model-len", "128", "--kv-cache-memory-bytes", str(16 << 20)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A Llama with random weights saved as safetensors."""
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY),
                                                          dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_config_dir(tmp_path_factory) -> str:
    """config.json only, for --load-format dummy."""
    path = tmp_path_factory.mktemp("tiny_llama_config")
    transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return str(path)
