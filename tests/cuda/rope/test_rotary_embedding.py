"""rotary_embedding on CPU and CUDA against the float64 reference (tests/reference/rope.py).

query and key are, by default, views of one fused qkv projection output (a token stride wider
than the heads), as the attention layers pass them; the value part must come back untouched.
"""

import pytest
import torch

from pyorch import _ops
from tests.conftest import DEVICES, tol
from tests.reference import rope as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (head_size, rot_dim): full rotary for the common head sizes, and partial rotary.
HEADS = [(64, 64), (80, 80), (96, 96), (128, 128), (256, 256), (128, 64), (80, 32), (256, 64)]
# (num_tokens, num_heads, num_kv_heads)
TOKENS = [(1, 32, 8), (7, 7, 1), (83, 1, 1), (989, 32, 8)]
MAX_POSITION = 4096


def _qkv(num_tokens, num_heads, num_kv_heads, head_size, dtype, device, pad=0):
    """query [T, nh * hs] and key [T, nkv * hs] as views of one [T, (nh + 2 nkv) * hs + pad]."""
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size + pad, dtype=dtype, device=device)
    return qkv, qkv[:, pad : pad + q_size], qkv[:, pad + q_size : pad + q_size + kv_size]


def _run_and_check(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cache: torch.Tensor,
    is_neox: bool,
) -> None:
    want_q, want_k = ref.rotary_embedding(positions, query, key, head_size, cache, is_neox)
    _ops.rotary_embedding(positions, query, key, head_size, cache, is_neox)
    torch.testing.assert_close(query, want_q, **tol(query.dtype))
    if key is not None:
        torch.testing.assert_close(key, want_k, **tol(key.dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", HEADS)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads", TOKENS)
def test_rotary_embedding(
    device: str,
    dtype: torch.dtype,
    is_neox: bool,
    head_size: int,
    rot_dim: int,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
):
    qkv, query, key = _qkv(num_tokens, num_heads, num_kv_heads, head_size, dtype, device)
    value_before = qkv[:, query.shape[1] + key.shape[1] :].clone()
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), device=device)
    cache = ref.cos_sin_cache(MAX_POSITION, rot_dim, dtype).to(device)
    _run_and_check(positions, query, key, head_size, cache, is_neox)
    torch.testing.assert_close(
        qkv[:, query.shape[1] + key.shape[1] :], value_before, rtol=0, atol=0
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_3d_heads(device: str, dtype: torch.dtype, is_neox: bool):
    # [T, heads, head_size] views with a padded head stride (head_size + 8) and a padded token stride.
    num_tokens, num_heads, num_kv_heads, head_size, rot_dim = 83, 7, 3, 128, 96
    q_base = torch.randn(num_tokens, num_heads + 1, head_size + 8, dtype=dtype, device=device)
    k_base = torch.randn(num_tokens, num_kv_heads, head_size + 8, dtype=dtype, device=device)
    query, key = q_base[:, :num_heads, :head_size], k_base[..., 8:]
    q_pad_before, k_pad_before = q_base[:, :, head_size:].clone(), k_base[..., :8].clone()
    spare_head_before = q_base[:, num_heads].clone()
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), device=device)
    cache = ref.cos_sin_cache(MAX_POSITION, rot_dim, dtype).to(device)
    _run_and_check(positions, query, key, head_size, cache, is_neox)
    assert torch.equal(q_base[:, :, head_size:], q_pad_before)
    assert torch.equal(q_base[:, num_heads], spare_head_before)
    assert torch.equal(k_base[..., :8], k_pad_before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("pad", [1, 2, 4])
def test_rotary_embedding_misaligned(device: str, dtype: torch.dtype, is_neox: bool, pad: int):
    # qkv shifted by `pad` elements: the views are not 16-byte aligned (the narrow-vector paths).
    _, query, key = _qkv(7, 4, 2, 64, dtype, device, pad=pad)
    positions = torch.randint(0, MAX_POSITION, (7,), device=device)
    cache = ref.cos_sin_cache(MAX_POSITION, 64, dtype).to(device)
    _run_and_check(positions, query, key, 64, cache, is_neox)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_key_none(device: str, dtype: torch.dtype, is_neox: bool):
    _, query, _ = _qkv(83, 7, 1, 128, dtype, device)
    positions = torch.randint(0, MAX_POSITION, (83,), device=device)
    cache = ref.cos_sin_cache(MAX_POSITION, 128, dtype).to(device)
    _run_and_check(positions, query, None, 128, cache, is_neox)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_float32_cache(device: str, dtype: torch.dtype, is_neox: bool):
    _, query, key = _qkv(83, 8, 2, 128, dtype, device)
    positions = torch.randint(0, MAX_POSITION, (83,), device=device)
    cache = ref.cos_sin_cache(MAX_POSITION, 128, torch.float32).to(device)
    _run_and_check(positions, query, key, 128, cache, is_neox)


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_embedding_edges(device: str):
    # No tokens; and the last cache row (position max_position - 1).
    cache = ref.cos_sin_cache(16, 64, torch.float32).to(device)
    empty = torch.empty(0, 128, device=device)
    _ops.rotary_embedding(
        torch.empty(0, dtype=torch.long, device=device), empty, None, 64, cache, True
    )
    _, query, key = _qkv(2, 2, 1, 64, torch.float32, device)
    positions = torch.tensor([15, 0], device=device)
    _run_and_check(positions, query, key, 64, cache, False)


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_embedding_rejects_bad_inputs(device: str):
    _, query, key = _qkv(4, 2, 1, 64, torch.float32, device)
    positions = torch.randint(0, 16, (4,), device=device)
    with pytest.raises(RuntimeError, match="rot_dim"):  # odd rot_dim
        _ops.rotary_embedding(positions, query, key, 64, torch.randn(16, 63, device=device), True)
    with pytest.raises(RuntimeError, match="rot_dim"):  # rot_dim > head_size
        _ops.rotary_embedding(positions, query, key, 64, torch.randn(16, 128, device=device), True)
    int_query = torch.zeros(4, 128, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="dtype"):
        _ops.rotary_embedding(
            positions, int_query, None, 64, torch.randn(16, 64, device=device), True
        )
    with pytest.raises(RuntimeError, match="head_size"):  # width not a multiple of head_size
        _ops.rotary_embedding(
            positions, query[:, :100], None, 64, torch.randn(16, 64, device=device), True
        )
    with pytest.raises(RuntimeError, match="dtype"):  # cache in a third dtype
        cache = torch.randn(16, 64, device=device, dtype=torch.float16)
        _ops.rotary_embedding(positions, query.to(torch.bfloat16), None, 64, cache, True)


def test_rotary_embedding_rejects_out_of_range_position_cpu():
    # Checked on CPU only: the CUDA kernel cannot check without a device sync (documented).
    _, query, key = _qkv(4, 2, 1, 64, torch.float32, "cpu")
    cache = ref.cos_sin_cache(16, 64, torch.float32)
    with pytest.raises(RuntimeError, match="position"):
        _ops.rotary_embedding(torch.tensor([0, 1, 16, 2]), query, key, 64, cache, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_key", [True, False])
def test_opcheck(device: str, with_key: bool):
    _, query, key = _qkv(5, 4, 2, 64, torch.float32, device)
    positions = torch.randint(0, 32, (5,), device=device)
    cache = ref.cos_sin_cache(32, 32, torch.float32).to(device)
    args = (positions, query.clone(), key.clone() if with_key else None, 64, cache, True)
    torch.library.opcheck(torch.ops.pyorch.rotary_embedding.default, args)
