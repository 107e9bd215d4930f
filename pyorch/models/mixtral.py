"""Mixtral: the Llama decoder with a top-2 (renormalized) mixture of SwiGLU experts as MLP."""

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pyorch.layers.quantization import QuantizationConfig
from pyorch.models.llama import LlamaForCausalLM
from pyorch.models.moe import SparseMoeBlock, check_softmax_routing, load_moe_weights


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_mlp(
        cls, config: Any, layer_idx: int, quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> nn.Module:
        check_softmax_routing(config)
        return SparseMoeBlock(
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
            config.intermediate_size, renormalize=True, hidden_act=config.hidden_act,
            quant_config=quant_config, prefix=prefix,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = getattr(self.config, "tie_word_embeddings", False)
        return load_moe_weights(
            self, weights, rename=(".block_sparse_moe.", ".mlp."),
            skip_prefixes=("lm_head.",) if tied else (),
        )
