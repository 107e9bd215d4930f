"""Reference rotary embedding (vLLM semantics), in float64, rounded once to the input dtype."""

import torch


def _rotate(
    x: torch.Tensor,  # [num_tokens, num_heads, rot_dim] float64
    cos: torch.Tensor,  # [num_tokens, 1, rot_dim // 2] float64
    sin: torch.Tensor,  # [num_tokens, 1, rot_dim // 2] float64
    is_neox: bool,
) -> torch.Tensor:
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def _apply(
    x: torch.Tensor,  # [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size]
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_size: int,
    is_neox: bool,
) -> torch.Tensor:
    rot_dim = 2 * cos.shape[-1]
    heads = x.double().reshape(x.shape[0], -1, head_size)
    rotated = _rotate(heads[..., :rot_dim], cos, sin, is_neox)
    out = torch.cat((rotated, heads[..., rot_dim:]), dim=-1)
    return out.reshape(x.shape).to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,  # [max_position, rot_dim] = [cos | sin]
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns the rotated (query, key) as new tensors; the inputs are not modified.

    The cache is used exactly as stored (its values already rounded to its dtype), the math is
    float64, and each output element is rounded once: the op computes in fp32 and rounds once.
    """
    cos_sin = cos_sin_cache.double()[positions.long()]
    cos, sin = (c.unsqueeze(1) for c in cos_sin.chunk(2, dim=-1))
    new_query = _apply(query, cos, sin, head_size, is_neox)
    new_key = None if key is None else _apply(key, cos, sin, head_size, is_neox)
    return new_query, new_key


def cos_sin_cache(
    max_position: int, rot_dim: int, dtype: torch.dtype, base: float = 10000.0
) -> torch.Tensor:
    """[max_position, rot_dim] = [cos(pos * inv_freq) | sin(pos * inv_freq)], HF's default RoPE."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
