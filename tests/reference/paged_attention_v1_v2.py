"""Reference for vLLM's paged_attention_v1/v2 on the split KV layout, in float64.

Walks each sequence's block table token by token (gathered with index tensors: token t lives in
block block_tables[i, t // block_size] at offset t % block_size), so it never touches cache slots
past a sequence's length.
"""

import torch

PARTITION_SIZE = 512


def split_cache_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte group of the key layout (vLLM's x)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def dequantize(cache: torch.Tensor, kv_cache_dtype: str, scale: float) -> torch.Tensor:
    """Cache values as float64: fp8 bytes times scale, or the model dtype as is."""
    if kv_cache_dtype == "auto":
        return cache.double()
    if cache.dtype == torch.uint8:
        cache = cache.view(torch.float8_e4m3fn)
    return cache.double() * scale


def gather_kv(
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_size, block_size]
    block_table: torch.Tensor,  # [max_blocks_per_seq]
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of tokens 0..seq_len-1, each [seq_len, num_kv_heads, head_size]."""
    block_size = value_cache.shape[3]
    head_size = value_cache.shape[2]
    pos = torch.arange(seq_len, device=block_table.device)
    blocks = block_table.long()[pos // block_size]
    offsets = pos % block_size
    keys = key_cache[blocks, :, :, offsets, :]  # [seq_len, num_kv_heads, head_size // x, x]
    values = value_cache[blocks, :, :, offsets]  # [seq_len, num_kv_heads, head_size]
    return keys.reshape(seq_len, -1, head_size), values


def paged_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """out[i, h] = softmax(scale * q.k + slope_h * (t - (seq_len - 1))) @ v, in query's dtype.

    An empty sequence gives zeros.
    """
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = value_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_heads, head_size, dtype=torch.float64, device=query.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        keys, values = gather_kv(key_cache, value_cache, block_tables[i], seq_len)
        k = dequantize(keys, kv_cache_dtype, k_scale).repeat_interleave(group, dim=1)
        v = dequantize(values, kv_cache_dtype, v_scale).repeat_interleave(group, dim=1)
        q = query[i].double()  # [num_heads, head_size]
        scores = scale * torch.einsum("hd,thd->ht", q, k)  # [num_heads, seq_len]
        if alibi_slopes is not None:
            pos = torch.arange(seq_len, device=query.device, dtype=torch.float64)
            scores = scores + alibi_slopes.double()[:, None] * (pos - (seq_len - 1))[None, :]
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("ht,thd->hd", probs, v)
    return out.to(query.dtype)
