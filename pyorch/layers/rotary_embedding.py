"""Rotary position embedding over pyorch's rotary_embedding op, with HF's frequency scalings.

The cos/sin cache is computed the way transformers computes its cos/sin (inverse frequencies in
float32, `position * inv_freq` in float32, cos/sin times the attention factor, then rounded to the
model dtype), so a model matches its HF implementation position for position.
"""

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pyorch import _ops

if TYPE_CHECKING:
    from pyorch.layers.layernorm import RMSNorm

# HF rope_type values get_rope implements ("default" is plain RoPE).
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# One instance per distinct rope, shared by all layers: a long-context cache is large
# (131072 positions x 128 x 4 bytes = 64 MiB), and building it per layer would be slow too.
_ROPE_CACHE: dict[tuple[Any, ...], "RotaryEmbedding"] = {}


def get_rope_params(config: Any) -> dict[str, Any]:
    """A model config's rope parameters in transformers v5's flat `rope_parameters` form.

    Accepts both config forms: v5 (`config.rope_parameters = {"rope_type", "rope_theta", ...}`)
    and v4 (`config.rope_theta` plus an optional `config.rope_scaling` dict, whose type may be
    under the old "type" key). The result always has "rope_type", "rope_theta" and
    "partial_rotary_factor".
    NOTE(models): a local helper until pyorch.model_loader exposes one; keep them in step.
    """
    params = getattr(config, "rope_parameters", None)
    if params is not None and "rope_theta" not in params and "rope_type" not in params:
        raise NotImplementedError(f"Per-layer-type rope parameters are not supported: {params}")
    params = dict(params) if params else {}
    scaling = getattr(config, "rope_scaling", None)
    if scaling:  # v4 form (also tolerated next to a v5 dict)
        params = {**dict(scaling), **params}
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params.pop("type", None)
    params["rope_type"] = rope_type
    if "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    return params


def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:  # [rotary_dim // 2] fp32
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(base: float, rotary_dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    inv_freq = _default_inv_freq(base, rotary_dim)
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, rotary_dim: int, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, blend on a linear ramp; returns
    (inv_freq, attention_factor) where the factor scales cos and sin."""
    original_max = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original_max
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1.0 / pos_freqs
    ) * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding in place to query and key rows.

    `cos_sin_cache[pos] = [cos(pos * inv_freq) | sin(pos * inv_freq)] * attention_factor`, shape
    [max_position, rotary_dim]; the first `rotary_dim` elements of each head are rotated. Neox
    style pairs element i with i + rotary_dim / 2 (HF's rotate_half); GPT-J style pairs 2i, 2i+1.
    """

    cos_sin_cache: torch.Tensor  # a non-persistent buffer, registered in __init__

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,  # [rotary_dim // 2] float32
        is_neox_style: bool = True,
        dtype: torch.dtype | None = None,
        attention_factor: float = 1.0,
    ):
        super().__init__()
        if rotary_dim > head_size or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.is_neox_style = is_neox_style
        # Built on the CPU so the cache is the same whatever device the model is built on.
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq.to(device="cpu", dtype=torch.float32)[None, :]
        cache = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer(
            "cos_sin_cache", cache.to(dtype=dtype, device=torch.get_default_device()),
            persistent=False,
        )

    def _cache_for(self, query: torch.Tensor) -> torch.Tensor:
        # The model may be moved or cast after construction; follow the query once.
        if self.cos_sin_cache.device != query.device or self.cos_sin_cache.dtype != query.dtype:
            self.cos_sin_cache = self.cos_sin_cache.to(device=query.device, dtype=query.dtype)
        return self.cos_sin_cache

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads * head_size], rotated in place
        key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads * head_size], in place
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = self._cache_for(query)
        _ops.rotary_embedding(positions, query, key, self.head_size, cache, self.is_neox_style)
        return query, key

    def forward_and_cache(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads * head_size], rotated in place
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], rotated in place
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = padding
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
        qk_norm: "tuple[RMSNorm, RMSNorm] | None" = None,  # normalizes each head first
    ) -> None:
        """forward, then the rotated key and the value written into the caches at their slots
        (reshape_and_cache_flash), in one kernel; with qk_norm (the caller checked
        qk_norm_fusable), every query and key head is RMS-normalized before it rotates."""
        cache = self._cache_for(query)
        q_w = k_w = None
        eps = 1e-6
        if qk_norm is not None:
            q_w, k_w = qk_norm[0].weight, qk_norm[1].weight
            eps = qk_norm[0].variance_epsilon
        _ops.rotary_embedding_and_cache(
            positions, query, key, value, self.head_size, cache, self.is_neox_style, key_cache,
            value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, q_w, k_w, eps,
        )

    def forward_native(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads * head_size]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pure-torch reference (HF's arithmetic: cos/sin in the model dtype); returns copies."""
        cos, sin = self._cache_for(query)[positions].chunk(2, dim=-1)  # [num_tokens, rot / 2]
        return self._rotate(query, cos, sin), None if key is None else self._rotate(key, cos, sin)

    def _rotate(
        self,
        # [num_tokens, num_heads * head_size] (or [num_tokens, num_heads, head_size])
        x: torch.Tensor,
        cos: torch.Tensor,  # [num_tokens, rotary_dim // 2]
        sin: torch.Tensor,  # [num_tokens, rotary_dim // 2]
    ) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_size)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
            rotated = rot * cos2 + torch.cat([-x2, x1], dim=-1) * sin2
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([rotated, rest], dim=-1).reshape(shape)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}, is_neox_style={self.is_neox_style}"
        )


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    is_neox_style: bool = True,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding:
    """Builds the rotary embedding for a rope config (vLLM's get_rope); identical requests
    return the same (shared) module.

    rope_scaling is None for plain RoPE, or an HF rope dict with "rope_type" (or "type") among
    default, linear, llama3 and yarn plus that type's keys (`get_rope_params` gives this form;
    its "rope_theta" and "partial_rotary_factor" keys are ignored here).
    """
    dtype = dtype or torch.get_default_dtype()
    key = (head_size, rotary_dim, max_position, base, is_neox_style, dtype,
           str(torch.get_default_device()), repr(sorted((rope_scaling or {}).items(), key=str)))
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = _build_rope(
            head_size, rotary_dim, max_position, base, rope_scaling, is_neox_style, dtype
        )
    return _ROPE_CACHE[key]


def _build_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None,
    is_neox_style: bool,
    dtype: torch.dtype,
) -> RotaryEmbedding:
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    attention_factor = 1.0
    if rope_type == "default":
        inv_freq = _default_inv_freq(base, rotary_dim)
    elif rope_type == "linear":
        inv_freq = _default_inv_freq(base, rotary_dim) / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(base, rotary_dim, scaling)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(base, rotary_dim, scaling, max_position)
        # The cache must cover the extended context even if max_position is the original one.
        factor = scaling.get("factor") or 1.0
        max_position = max(max_position, int(scaling["original_max_position_embeddings"] * factor))
    else:
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported; supported: {list(_SUPPORTED_ROPE_TYPES)}"
        )
    return RotaryEmbedding(
        head_size, rotary_dim, max_position, inv_freq, is_neox_style, dtype, attention_factor
    )
