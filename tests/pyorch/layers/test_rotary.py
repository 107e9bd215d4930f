"""Rotary embedding: our cos/sin cache and rotation against transformers' implementation, and the
rotary_embedding op against forward_native."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pyorch.layers.rotary_embedding import get_rope, get_rope_params
from tests.conftest import DEVICES, tol

HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, MAX_POS = 64, 4, 2, 4096

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn_v4_type_key": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
                         "beta_fast": 16, "beta_slow": 2},
}


def _hf_config(scaling: dict | None, theta: float = 500000.0) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=NUM_HEADS * HEAD_DIM, num_attention_heads=NUM_HEADS, head_dim=HEAD_DIM,
        num_key_value_heads=NUM_KV_HEADS, max_position_embeddings=MAX_POS, rope_theta=theta,
        rope_scaling=scaling,
    )


def _ours(config: LlamaConfig, dtype: torch.dtype = torch.float32, is_neox: bool = True):
    params = get_rope_params(config)
    return get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, params["rope_theta"],
                    params if params["rope_type"] != "default" else None, is_neox, dtype)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_cos_sin_cache_matches_transformers(name: str):
    config = _hf_config(SCALINGS[name])
    rope = _ours(config)
    positions = torch.arange(MAX_POS)
    cos, sin = LlamaRotaryEmbedding(config)(torch.empty(1, dtype=torch.float32), positions[None])
    half = HEAD_DIM // 2
    assert rope.cos_sin_cache.shape[1] == HEAD_DIM and rope.cos_sin_cache.shape[0] >= MAX_POS
    torch.testing.assert_close(rope.cos_sin_cache[:MAX_POS, :half], cos[0, :, :half],
                               atol=0, rtol=0)
    torch.testing.assert_close(rope.cos_sin_cache[:MAX_POS, half:], sin[0, :, :half],
                               atol=0, rtol=0)


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_matches_transformers(name: str, dtype: torch.dtype):
    config = _hf_config(SCALINGS[name])
    rope = _ours(config, dtype)
    num_tokens = 37
    positions = torch.randint(0, MAX_POS, (num_tokens,))
    q = torch.randn(num_tokens, NUM_HEADS * HEAD_DIM, dtype=dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS * HEAD_DIM, dtype=dtype)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(
        q.view(1, num_tokens, NUM_HEADS, HEAD_DIM).transpose(1, 2),
        k.view(1, num_tokens, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2), cos, sin,
    )
    ours_q, ours_k = rope.forward_native(positions, q, k)
    torch.testing.assert_close(ours_q, hf_q.transpose(1, 2).reshape(num_tokens, -1))
    torch.testing.assert_close(ours_k, hf_k.transpose(1, 2).reshape(num_tokens, -1))


def test_get_rope_params_v4_and_v5_forms():
    class V4:
        rope_theta = 1e6
        rope_scaling = {"type": "linear", "factor": 2.0}

    class V5:
        rope_parameters = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}

    class Bare:
        pass

    assert get_rope_params(V4()) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6,
                                     "partial_rotary_factor": 1.0}
    assert get_rope_params(V5())["rope_type"] == "llama3"
    assert get_rope_params(V5())["rope_theta"] == 5e5
    assert get_rope_params(Bare()) == {"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 1.0}


def test_unsupported_rope_type_raises():
    with pytest.raises(NotImplementedError, match="longrope"):
        get_rope(64, 64, 128, 1e4, {"rope_type": "longrope"})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2])
def test_op_matches_native(device: str, dtype: torch.dtype, is_neox: bool, rotary_dim: int):
    rope = get_rope(HEAD_DIM, rotary_dim, MAX_POS, 10000.0, SCALINGS["llama3"], is_neox, dtype)
    rope = rope.to(device)
    num_tokens = 83
    positions = torch.randint(0, MAX_POS, (num_tokens,), device=device)
    # q and k as strided views of a fused qkv output, the way the models pass them.
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=dtype,
                      device=device)
    q, k, _ = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM],
                        dim=-1)
    want_q, want_k = rope.forward_native(positions, q, k)
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    torch.testing.assert_close(got_q, want_q, **tol(dtype, 2))
    torch.testing.assert_close(got_k, want_k, **tol(dtype, 2))
