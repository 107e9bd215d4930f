"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections."""

from typing import Any

from pyorch.models.llama import AttentionOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)
