"""Pure-PyTorch references for the KV-cache ops. Each returns new caches and leaves its inputs alone.

The writes are exact (a copy, or torch's own fp8 conversion), so tests compare bit for bit.
"""

import torch

FP8_MAX = 448.0


def to_cache_dtype(x: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor) -> torch.Tensor:
    """x as the cache stores it: as is (auto) or fp8(clamp(x / scale, -448, 448)) as raw bytes."""
    if kv_cache_dtype == "auto":
        return x
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8)


def _writable(cache: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of cache, and the view to index into (bytes for fp8: index_put has no fp8 kernel)."""
    out = cache.clone()
    return out, (out if kv_cache_dtype == "auto" else out.view(torch.uint8))


def reshape_and_cache_flash(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 skips
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    key_cache, kc = _writable(key_cache, kv_cache_dtype)
    value_cache, vc = _writable(value_cache, kv_cache_dtype)
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    kc[blocks, offsets] = to_cache_dtype(key[valid], kv_cache_dtype, k_scale)
    vc[blocks, offsets] = to_cache_dtype(value[valid], kv_cache_dtype, v_scale)
    return key_cache, value_cache


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_size / x, block_size, x]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_size, block_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 skips
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    key_cache, kc = _writable(key_cache, kv_cache_dtype)
    value_cache, vc = _writable(value_cache, kv_cache_dtype)
    _, num_kv_heads, chunks, block_size, x = key_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    k = to_cache_dtype(key[valid], kv_cache_dtype, k_scale)
    v = to_cache_dtype(value[valid], kv_cache_dtype, v_scale)
    # Advanced indices on dims 0 and 3 (separated by slices) move to the front: [n, H, D/x, x].
    kc[blocks, :, :, offsets, :] = k.reshape(-1, num_kv_heads, chunks, x)
    vc[blocks, :, :, offsets] = v
    return key_cache, value_cache


def copy_blocks(
    key_caches: list[torch.Tensor],  # [num_layers] of [num_blocks, ...]
    value_caches: list[torch.Tensor],  # [num_layers] of [num_blocks, ...]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src, dst)
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    src, dst = block_mapping[:, 0].cpu(), block_mapping[:, 1].cpu()
    out_k, out_v = [], []
    for k, v in zip(key_caches, value_caches):
        k, v = k.clone(), v.clone()
        k[dst.to(k.device)] = k[src.to(k.device)]
        v[dst.to(v.device)] = v[src.to(v.device)]
        out_k.append(k)
        out_v.append(v)
    return out_k, out_v


def swap_blocks(
    src: torch.Tensor,  # [num_src_blocks, ...]
    dst: torch.Tensor,  # [num_dst_blocks, ...]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src, dst)
) -> torch.Tensor:
    out = dst.clone()
    out[block_mapping[:, 1].to(dst.device)] = src[block_mapping[:, 0].to(src.device)].to(dst.device)
    return out
