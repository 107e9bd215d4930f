"""Qwen2-MoE: Qwen2's attention (qkv bias) with sparse MoE blocks that add a sigmoid-gated shared
expert; layers in mlp_only_layers or off decoder_sparse_step keep a dense MLP."""

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pyorch.layers.quantization import QuantizationConfig
from pyorch.models.llama import AttentionOptions, LlamaForCausalLM, dense_mlp
from pyorch.models.moe import (
    SparseMoeBlock,
    check_softmax_routing,
    is_sparse_layer,
    load_moe_weights,
)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    # Qwen3-MoE sets this to False: its MoE blocks have no shared expert.
    shared_expert = True

    @classmethod
    def attention_options(cls, config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True)

    @classmethod
    def make_mlp(
        cls, config: Any, layer_idx: int, quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> nn.Module:
        check_softmax_routing(config)
        if not is_sparse_layer(config, layer_idx):
            return dense_mlp(config, layer_idx, quant_config, prefix)
        return SparseMoeBlock(
            config.hidden_size, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
            hidden_act=config.hidden_act,
            shared_expert_intermediate_size=(
                config.shared_expert_intermediate_size if cls.shared_expert else 0),
            quant_config=quant_config, prefix=prefix,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = getattr(self.config, "tie_word_embeddings", False)
        return load_moe_weights(self, weights, skip_prefixes=("lm_head.",) if tied else ())
