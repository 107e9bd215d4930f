"""Reference paged attention and merge_attn_states, in float64, written for clarity.

The paged reference walks the block table token by token (position -> block id, offset), the way
vLLM's reference does, then applies the op's semantics: sequence i's queries are its last
q_len_i positions; causal queries see keys at positions <= their own; a sliding window keeps only
keys with position > pos - sliding_window; a soft cap maps s to cap * tanh(s / cap).
"""

import torch


def dequantize_cache(cache: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor) -> torch.Tensor:
    """A cache in float64: fp8 e4m3 bytes times their scale, or the cache itself."""
    if kv_cache_dtype == "auto":
        return cache.double()
    return cache.view(torch.float8_e4m3fn).double() * scale.double().item()


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_size]: key/value of every position, through the block table."""
    block_size = cache.shape[1]
    rows = []
    for pos in range(seq_len):
        block = int(block_table_row[pos // block_size])
        rows.append(cache[block, pos % block_size])
    return torch.stack(rows) if rows else cache.new_zeros((0, *cache.shape[2:]))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 [query_start_loc[-1], num_heads, head_size]; rows of a q_len-0 sequence are absent."""
    return paged_attention_with_lse(
        query, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale, causal,
        sliding_window, logits_soft_cap, kv_cache_dtype, k_scale, v_scale,
    )[0]


def paged_attention_with_lse(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention's output and the float64 [num_heads, query_start_loc[-1]] natural-log
    log-sum-exp of each row's scaled (capped) visible scores, -inf for a row that sees nothing."""
    one = torch.ones(1)
    k_all = dequantize_cache(key_cache.cpu(), kv_cache_dtype, k_scale if k_scale is not None else one)
    v_all = dequantize_cache(value_cache.cpu(), kv_cache_dtype, v_scale if v_scale is not None else one)
    q_all = query.cpu().double()
    qsl = query_start_loc.cpu().tolist()
    num_heads, head_size = query.shape[1], query.shape[2]
    group = num_heads // key_cache.shape[2]
    out = torch.zeros(qsl[-1], num_heads, head_size, dtype=torch.float64)
    lse = torch.full((num_heads, qsl[-1]), float("-inf"), dtype=torch.float64)
    for i, seq_len in enumerate(seq_lens.cpu().tolist()):
        q_len = qsl[i + 1] - qsl[i]
        if q_len == 0:
            continue
        k = gather_kv(k_all, block_table[i].cpu(), seq_len).repeat_interleave(group, dim=1)
        v = gather_kv(v_all, block_table[i].cpu(), seq_len).repeat_interleave(group, dim=1)
        q = q_all[qsl[i] : qsl[i + 1]]
        s = torch.einsum("thd,khd->htk", q, k) * scale
        if logits_soft_cap > 0:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        key = torch.arange(seq_len)[None, :]
        visible = torch.ones(q_len, seq_len, dtype=torch.bool)
        if causal:
            visible &= key <= pos
        if sliding_window > 0:
            visible &= key > pos - sliding_window
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees nothing gives zeros
        out[qsl[i] : qsl[i + 1]] = torch.einsum("htk,khd->thd", p, v)
        lse[:, qsl[i] : qsl[i + 1]] = torch.logsumexp(s, dim=-1)
    return out, lse


def merge_attn_states(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [T, H, D] float64, lse [H, T] float64); +inf lse counts as -inf, both empty -> 0."""
    p_lse = prefix_lse.double().clone()
    s_lse = suffix_lse.double().clone()
    p_lse[p_lse.isinf()] = float("-inf")
    s_lse[s_lse.isinf()] = float("-inf")
    m = torch.maximum(p_lse, s_lse)
    empty = m == float("-inf")
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    p_w = torch.exp(p_lse - m_safe)
    s_w = torch.exp(s_lse - m_safe)
    total = p_w + s_w
    p_scale = torch.where(empty, 0.0, p_w / total.clamp_min(1e-300)).T[:, :, None]
    s_scale = torch.where(empty, 0.0, s_w / total.clamp_min(1e-300)).T[:, :, None]
    po = torch.where(p_scale > 0, prefix_output.double(), 0.0)
    so = torch.where(s_scale > 0, suffix_output.double(), 0.0)
    out = po * p_scale + so * s_scale
    lse = torch.where(empty, float("-inf"), torch.log(total) + m_safe)
    return out, lse
