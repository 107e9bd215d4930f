"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with sparse MoE blocks (no shared expert;
the top-k weights are renormalized when norm_topk_prob)."""

from typing import Any

from pyorch.models.llama import AttentionOptions
from pyorch.models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    shared_expert = False

    @classmethod
    def attention_options(cls, config: Any) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
