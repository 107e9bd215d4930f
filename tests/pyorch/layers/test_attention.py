"""The Attention layer over a small paged cache, on a mixed batch (prefill, chunked prefill,
decode, padding), against torch SDPA on the dense per-sequence keys and values."""

import pytest
import torch
import torch.nn.functional as F

from pyorch.forward_context import get_forward_context, set_forward_context
from pyorch.layers.attention import Attention
from tests.conftest import DEVICES, tol
from tests.pyorch.paged_batch import allocate_blocks, build_metadata

BLOCK_SIZE = 16
# (cached tokens, new tokens) per sequence: a prefill, a chunked prefill, decodes, a long prefill.
BATCH = [(0, 17), (10, 7), (30, 1), (16, 1), (0, 40)]
TOLS = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
        torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _reference(q, k, v, ctx, q_len, scale, window, soft_cap):  # type: ignore[no-untyped-def]
    """q: [q_len, H, D]; k, v: [ctx + q_len, KVH, D] -> [q_len, H, D], in float32."""
    num_heads, num_kv = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(num_heads // num_kv, dim=1)
    v = v.float().repeat_interleave(num_heads // num_kv, dim=1)
    q_pos = torch.arange(ctx, ctx + q_len, device=q.device)[:, None]
    k_pos = torch.arange(ctx + q_len, device=q.device)[None, :]
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    if soft_cap:
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
        scores = soft_cap * torch.tanh(scores / soft_cap)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
# (64, 4, 1) and (64, 2, 1): one rank of a one-KV-head model at TP=1 and TP=2 (the KV head
# replicated), the two shapes tensor parallelism compares.
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads",
                         [(64, 4, 2), (128, 4, 4), (64, 8, 1), (64, 4, 1), (64, 2, 1)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (8, None), (None, 30.0)])
def test_attention_mixed_batch(device: str, dtype: torch.dtype, head_size: int, num_heads: int,
                               num_kv_heads: int, window: int | None, soft_cap: float | None):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA paged_attention kernel takes fp16/bf16 only (as FlashAttention)")
    ctx_lens = [c for c, _ in BATCH]
    q_lens = [q for _, q in BATCH]
    tables, num_blocks = allocate_blocks([c + q for c, q in BATCH], BLOCK_SIZE, shuffle=True)
    meta, _ = build_metadata(ctx_lens, q_lens, tables, BLOCK_SIZE, device, num_padding_tokens=2)
    scale = head_size**-0.5
    layer = Attention(num_heads, head_size, scale, num_kv_heads, layer_idx=3,
                      sliding_window=window, logits_soft_cap=soft_cap).to(device)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    key_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
    value_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
    layer.kv_cache = (key_cache, value_cache)

    # Full per-sequence keys/values; the cached prefix is written into the cache directly.
    full_k = [torch.randn(c + q, num_kv_heads, head_size, dtype=dtype, device=device)
              for c, q in BATCH]
    full_v = [torch.randn_like(k) for k in full_k]
    for k, v, table, (ctx, _) in zip(full_k, full_v, tables, BATCH):
        for pos in range(ctx):
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            key_cache[block, offset], value_cache[block, offset] = k[pos], v[pos]

    num_tokens = sum(q_lens) + 2
    # The layer takes q/k/v as column slices of one fused qkv tensor, like the models give it.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype,
                      device=device)
    q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size,
                         num_kv_heads * head_size], dim=-1)
    new_k = torch.cat([fk[c:] for fk, (c, _) in zip(full_k, BATCH)]).flatten(1)
    new_v = torch.cat([fv[c:] for fv, (c, _) in zip(full_v, BATCH)]).flatten(1)
    k[: sum(q_lens)], v[: sum(q_lens)] = new_k, new_v
    with set_forward_context(meta):
        out = layer(q, k, v)
    assert out.shape == (num_tokens, num_heads * head_size)

    start = 0
    for i, (ctx, q_len) in enumerate(BATCH):
        rows = q[start:start + q_len].view(q_len, num_heads, head_size)
        want = _reference(rows, full_k[i], full_v[i], ctx, q_len, scale, window, soft_cap)
        got = out[start:start + q_len].view(q_len, num_heads, head_size)
        torch.testing.assert_close(got.float(), want, **TOLS[dtype], msg=f"sequence {i}")
        start += q_len
    # Every new token's key and value landed in its slot (padding rows went nowhere).
    for i, (ctx, q_len) in enumerate(BATCH):
        for pos in range(ctx, ctx + q_len):
            block, offset = tables[i][pos // BLOCK_SIZE], pos % BLOCK_SIZE
            assert torch.equal(key_cache[block, offset], full_k[i][pos])
            assert torch.equal(value_cache[block, offset], full_v[i][pos])
    assert not key_cache[0].any()  # the reserved block is untouched


def test_attention_without_cache_raises():
    layer = Attention(4, 64, 0.125, 2)
    q, k, v = torch.randn(3, 256), torch.randn(3, 128), torch.randn(3, 128)
    with set_forward_context(None):
        with pytest.raises(RuntimeError, match="no attention metadata or KV cache"):
            layer(q, k, v)


def test_forward_context_nesting_and_errors():
    with pytest.raises(RuntimeError, match="forward context"):
        get_forward_context()
    with set_forward_context(None) as outer:
        with set_forward_context(None) as inner:
            assert get_forward_context() is inner
        assert get_forward_context() is outer


def test_attention_rejects_bad_heads_and_dtype():
    with pytest.raises(ValueError, match="multiple"):
        Attention(6, 64, 1.0, 4)
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is not supported"):
        Attention(4, 64, 1.0, 4, kv_cache_dtype="fp8_e5m2")
    layer = Attention(4, 64, 1.0, 4)
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'"):
        layer.set_kv_cache_dtype("int8")
    assert layer.kv_cache_dtype == "auto"


def _rope_batch(device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                head_size: int):
    """The paged batch of the rotary tests: (metadata, positions, caches' prefix, qkv, sizes)."""
    ctx_lens, q_lens = [c for c, _ in BATCH], [q for _, q in BATCH]
    tables, num_blocks = allocate_blocks([c + q for c, q in BATCH], BLOCK_SIZE, shuffle=True)
    meta, _ = build_metadata(ctx_lens, q_lens, tables, BLOCK_SIZE, device, num_padding_tokens=2)
    num_tokens = sum(q_lens) + 2
    positions = torch.cat([torch.arange(c, c + q) for c, q in BATCH] + [torch.zeros(2)]).long()
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    prefix = [torch.randn(cache_shape, dtype=dtype, device=device) for _ in range(2)]
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype,
                      device=device)
    sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
    return meta, positions.to(device), prefix, qkv, sizes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fuse", [True, False])
def test_attention_with_rotary(device: str, dtype: torch.dtype, fuse: bool, monkeypatch):
    """Given rotary_emb, the layer rotates q and k (in the cache-writing kernel, or as a separate
    op with _FUSE_ROPE_CACHE off): the output, the caches and q / k equal rotating first with the
    RotaryEmbedding layer and then calling the layer without it."""
    import pyorch.layers.attention as attention_module
    from pyorch.layers.rotary_embedding import RotaryEmbedding

    monkeypatch.setattr(attention_module, "_FUSE_ROPE_CACHE", fuse)
    num_heads, num_kv_heads, head_size = 4, 2, 64
    meta, positions, prefix, qkv, sizes = _rope_batch(device, dtype, num_heads, num_kv_heads,
                                                      head_size)
    num_real = sum(q for _, q in BATCH)
    inv_freq = 10000.0 ** -(torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    rope = RotaryEmbedding(head_size, head_size, 4096, inv_freq, True, dtype).to(device)
    outs = []
    for with_rope in (True, False):
        layer = Attention(num_heads, head_size, head_size**-0.5, num_kv_heads).to(device)
        layer.kv_cache = (prefix[0].clone(), prefix[1].clone())
        x = qkv.clone()
        q, k, v = x.split(sizes, dim=-1)
        with set_forward_context(meta):
            if with_rope:
                out = layer(q, k, v, positions=positions, rotary_emb=rope)
            else:
                rope(positions, q, k)
                out = layer(q, k, v)
        outs.append((out[:num_real], x, *layer.kv_cache))  # padding rows: never written
    for name, got, want in zip(["out", "qkv", "key_cache", "value_cache"], outs[0], outs[1]):
        assert torch.equal(got, want), name
    with set_forward_context(meta), pytest.raises(ValueError, match="needs positions"):
        layer(q, k, v, rotary_emb=rope)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("rot_dim", [64, 32])
def test_attention_with_qk_norm(device: str, dtype: torch.dtype, fuse: bool, rot_dim: int,
                                monkeypatch):
    """Given qk_norm (Qwen3's per-head RMSNorms), the layer normalizes q and k before rotating
    them: in the cache-writing kernel when it can (fused, whole heads rotating), else with the
    norm layers first. Either way it matches normalizing and rotating first and calling the
    layer without either (exactly where the same ops run; to rounding in the fused kernel, whose
    sums of squares add in another order)."""
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA paged_attention kernel takes fp16/bf16 only")
    import pyorch.layers.attention as attention_module
    from pyorch.layers.layernorm import RMSNorm
    from pyorch.layers.rotary_embedding import RotaryEmbedding

    monkeypatch.setattr(attention_module, "_FUSE_ROPE_CACHE", fuse)
    num_heads, num_kv_heads, head_size = 4, 2, 64
    meta, positions, prefix, qkv, sizes = _rope_batch(device, dtype, num_heads, num_kv_heads,
                                                      head_size)
    num_tokens, num_real = qkv.shape[0], sum(q for _, q in BATCH)
    inv_freq = 10000.0 ** -(torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    rope = RotaryEmbedding(head_size, rot_dim, 4096, inv_freq, True, dtype).to(device)
    norms = []
    for _ in range(2):
        norm = RMSNorm(head_size, eps=1e-6, dtype=dtype).to(device)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.5 * torch.randn(head_size))
        norms.append(norm)
    outs = []
    for in_layer in (True, False):
        layer = Attention(num_heads, head_size, head_size**-0.5, num_kv_heads).to(device)
        layer.kv_cache = (prefix[0].clone(), prefix[1].clone())
        q, k, v = qkv.clone().split(sizes, dim=-1)
        with set_forward_context(meta):
            if in_layer:
                out = layer(q, k, v, positions=positions, rotary_emb=rope,
                            qk_norm=(norms[0], norms[1]))
            else:
                q = norms[0](q.reshape(-1, head_size)).view(num_tokens, -1)
                k = norms[1](k.reshape(-1, head_size)).view(num_tokens, -1)
                rope(positions, q, k)
                out = layer(q, k, v)
        outs.append((out[:num_real], *layer.kv_cache))
    in_kernel = fuse and rot_dim == head_size
    for name, got, want in zip(["out", "key_cache", "value_cache"], outs[0], outs[1], strict=True):
        if in_kernel:
            torch.testing.assert_close(got, want, **tol(dtype, 2), msg=name)
        else:
            assert torch.equal(got, want), name


def _fp8_round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    return ((x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_attention_fp8_cache(device: str, dtype: torch.dtype, kv_cache_dtype: str):
    """kv_cache_dtype fp8: the layer writes e4m3 bytes of k / k_scale and v / v_scale into uint8
    caches (the prefix written by an earlier step, the new tokens by this one) and attends over
    them as SDPA does over the fp8 round trip of the keys and values."""
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA paged_attention kernel takes fp16/bf16 only")
    num_heads, num_kv_heads, head_size = 8, 2, 64
    ctx_lens, q_lens = [c for c, _ in BATCH], [q for _, q in BATCH]
    tables, num_blocks = allocate_blocks([c + q for c, q in BATCH], BLOCK_SIZE, shuffle=True)
    prefix_meta, _ = build_metadata([0] * len(BATCH), ctx_lens, tables, BLOCK_SIZE, device)
    meta, _ = build_metadata(ctx_lens, q_lens, tables, BLOCK_SIZE, device, num_padding_tokens=2)
    scale = head_size**-0.5
    layer = Attention(num_heads, head_size, scale, num_kv_heads, kv_cache_dtype=kv_cache_dtype)
    layer = layer.to(device)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    layer.kv_cache = (torch.zeros(cache_shape, dtype=torch.uint8, device=device),
                      torch.zeros(cache_shape, dtype=torch.uint8, device=device))
    layer.k_scale.fill_(0.02)
    layer.v_scale.fill_(0.005)
    full_k = [torch.randn(c + q, num_kv_heads, head_size, dtype=dtype, device=device) * 3
              for c, q in BATCH]
    full_v = [torch.randn_like(k) for k in full_k]

    def run(meta_, lo, hi) -> torch.Tensor:  # type: ignore[no-untyped-def]
        n = meta_.slot_mapping.shape[0]
        k = torch.zeros(n, num_kv_heads * head_size, dtype=dtype, device=device)
        v = torch.zeros_like(k)
        real = sum(h - lo_ for lo_, h in zip(lo, hi, strict=True))
        k[:real] = torch.cat([fk[a:b] for fk, a, b in zip(full_k, lo, hi, strict=True)]).flatten(1)
        v[:real] = torch.cat([fv[a:b] for fv, a, b in zip(full_v, lo, hi, strict=True)]).flatten(1)
        q = torch.randn(n, num_heads * head_size, dtype=dtype, device=device)
        with set_forward_context(meta_):
            return q, layer(q, k, v)

    run(prefix_meta, [0] * len(BATCH), ctx_lens)  # writes the prefixes, scales 0.02 / 0.005
    q, out = run(meta, ctx_lens, [c + q for c, q in BATCH])
    start = 0
    for i, (ctx, q_len) in enumerate(BATCH):
        rows = q[start:start + q_len].view(q_len, num_heads, head_size)
        k_ref = _fp8_round_trip(full_k[i], 0.02)
        v_ref = _fp8_round_trip(full_v[i], 0.005)
        want = _reference(rows, k_ref, v_ref, ctx, q_len, scale, None, None)
        got = out[start:start + q_len].view(q_len, num_heads, head_size)
        torch.testing.assert_close(got.float(), want, **TOLS[dtype], msg=f"sequence {i}")
        start += q_len
    # The cache holds e4m3 bytes of the scaled keys (clamped to +-448: |k| / 0.02 reaches it).
    key_cache = layer.kv_cache[0]
    for i, (ctx, q_len) in enumerate(BATCH):
        pos = ctx + q_len - 1
        block, offset = tables[i][pos // BLOCK_SIZE], pos % BLOCK_SIZE
        want_bytes = (full_k[i][pos].float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(key_cache[block, offset].view(torch.float8_e4m3fn).float(),
                           want_bytes.float())
