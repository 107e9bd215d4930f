"""Paged attention layer: writes this step's keys/values to the KV cache, then attends over it.

One code path for every batch shape (prefills, chunked prefills, decodes, mixed) and device: the
metadata comes from the forward context and both steps are pyorch ops. Given the model's rotary
embedding, the layer also rotates query and key, in the kernel that writes the cache
(rotary_embedding_and_cache); tests also run the rotation and the write as two ops.
"""

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from pyorch import _ops
from pyorch.config import check_kv_cache_dtype
from pyorch.forward_context import AttentionMetadata, get_forward_context

if TYPE_CHECKING:
    from pyorch.layers.layernorm import RMSNorm
    from pyorch.layers.rotary_embedding import RotaryEmbedding

# Tests turn this off to compare the fused rotation + cache write with the two separate ops.
_FUSE_ROPE_CACHE = True


class Attention(nn.Module):
    """Causal multi-head / grouped-query attention over a paged KV cache.

    `kv_cache` is bound by the model runner: (key_cache, value_cache), each
    [num_blocks, block_size, num_kv_heads, head_size], in the model's dtype for kv_cache_dtype
    "auto" or uint8 e4m3 bytes for "fp8"/"fp8_e4m3" (the runner sets the layers' kv_cache_dtype
    from CacheConfig before it binds the cache, see set_kv_cache_dtype). `k_scale`/`v_scale` are
    the per-tensor fp8 scales (stored = x / scale, read = fp8 * scale): 1.0 unless the
    checkpoint has them (pyorch.model_loader.weight_utils.load_kv_scales). They are float32
    device tensors the ops read on the device, so CUDA graphs see a scale set after capture.
    """

    k_scale: torch.Tensor  # non-persistent buffers, registered in __init__
    v_scale: torch.Tensor

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        layer_idx: int = 0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        kv_cache_dtype: str = "auto",
    ):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                             f"{num_kv_heads}")
        check_kv_cache_dtype(kv_cache_dtype)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.register_buffer("k_scale", torch.tensor(1.0, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.tensor(1.0, dtype=torch.float32), persistent=False)

    def set_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """How this layer's cache stores K and V (set before a cache is bound)."""
        check_kv_cache_dtype(kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        positions: torch.Tensor | None = None,  # [num_tokens] int64, with rotary_emb
        rotary_emb: "RotaryEmbedding | None" = None,  # rotates query and key (in place) first
        # (q_norm, k_norm): RMSNorms over each query / key head, applied before the rotation
        # (Qwen3), in the rotation's kernel where it can take them
        qk_norm: "tuple[RMSNorm, RMSNorm] | None" = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        num_tokens = query.shape[0]
        out = torch.empty(
            num_tokens, self.num_heads, self.head_size, dtype=query.dtype, device=query.device
        )
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None or self.kv_cache is None:
            # No silent zeros: a forward without metadata or a bound cache is a runner bug.
            raise RuntimeError(
                f"Attention layer {self.layer_idx}: no attention metadata or KV cache bound "
                "(run the model inside set_forward_context after binding kv_cache)")
        if rotary_emb is not None and positions is None:
            raise ValueError(f"Attention layer {self.layer_idx}: rotary_emb needs positions")
        key_cache, value_cache = self.kv_cache
        fused = rotary_emb is not None and _FUSE_ROPE_CACHE
        if qk_norm is not None and not (fused and self._qk_norm_fusable(
                query, key, value, rotary_emb, qk_norm)):
            query, key = self._norm_heads(query, qk_norm[0]), self._norm_heads(key, qk_norm[1])
            qk_norm = None
        key_heads = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value_heads = value.view(num_tokens, self.num_kv_heads, self.head_size)
        if fused:
            assert positions is not None and rotary_emb is not None  # checked above
            rotary_emb.forward_and_cache(
                positions, query, key_heads, value_heads, key_cache, value_cache,
                attn_metadata.slot_mapping, self.kv_cache_dtype, self.k_scale, self.v_scale,
                qk_norm,
            )
        else:
            if rotary_emb is not None:
                rotary_emb(positions, query, key)
            _ops.reshape_and_cache_flash(
                key_heads, value_heads, key_cache, value_cache, attn_metadata.slot_mapping,
                self.kv_cache_dtype, self.k_scale, self.v_scale,
            )
        if attn_metadata.cascade is not None:
            self._cascade(out, query.view(num_tokens, self.num_heads, self.head_size),
                          key_cache, value_cache, attn_metadata)
            return out.view(num_tokens, -1)
        _ops.paged_attention(
            out,
            query.view(num_tokens, self.num_heads, self.head_size),
            key_cache,
            value_cache,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.block_table,
            attn_metadata.max_query_len,
            attn_metadata.max_seq_len,
            self.scale,
            True,
            self.sliding_window or 0,
            self.logits_soft_cap or 0.0,
            self.kv_cache_dtype,
            self.k_scale,
            self.v_scale,
        )
        return out.view(num_tokens, -1)

    def _qk_norm_fusable(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         rotary_emb: "RotaryEmbedding | None",
                         qk_norm: "tuple[RMSNorm, RMSNorm]") -> bool:
        q_norm, k_norm = qk_norm
        return (
            rotary_emb is not None
            and q_norm.variance_epsilon == k_norm.variance_epsilon
            and _ops.qk_norm_fusable(query, key, value, self.head_size, rotary_emb.rotary_dim,
                                     q_norm.weight, k_norm.weight)
        )

    def _norm_heads(self, x: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        # [T, heads * head_size] (a strided view of the qkv output) -> normed per head, contiguous.
        num_tokens = x.shape[0]
        return cast(torch.Tensor, norm(x.reshape(-1, self.head_size))).view(num_tokens, -1)

    def _cascade(self, out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Decode attention over shared prefixes (pyorch/executor/cascade.py), one op: every
        request's suffix into `out`, each group's prefix once for all its members' queries, the
        two merged in place by log-sum-exp. query/out: [num_tokens, num_heads, head_size]."""
        cascade = meta.cascade
        assert cascade is not None  # the caller checked
        if self.sliding_window:  # the runner plans no cascade for such models
            raise RuntimeError(f"Attention layer {self.layer_idx}: cascade attention with a "
                               "sliding window")
        _ops.cascade_attention(
            out, query, key_cache, value_cache, meta.query_start_loc, cascade.suffix_seq_lens,
            cascade.suffix_block_table, meta.max_query_len, cascade.suffix_max_seq_len,
            cascade.perm, cascade.prefix_query_start_loc, cascade.prefix_seq_lens,
            cascade.prefix_block_table, cascade.prefix_max_query_len, cascade.prefix_max_seq_len,
            self.scale, self.logits_soft_cap or 0.0, self.kv_cache_dtype, self.k_scale,
            self.v_scale,
        )

    def extra_repr(self) -> str:
        return (
            f"layer_idx={self.layer_idx}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"scale={self.scale:.4g}, kv_cache_dtype={self.kv_cache_dtype}, "
            f"sliding_window={self.sliding_window}, logits_soft_cap={self.logits_soft_cap}"
        )
