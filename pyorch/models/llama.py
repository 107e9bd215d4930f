"""Llama-family decoder (Llama 2/3/3.1, Mistral, SmolLM2); Qwen2 and Qwen3 reuse it.

Same module tree and parameter names as HF's LlamaForCausalLM, except that q/k/v are merged into
`qkv_proj` and gate/up into `gate_up_proj`; `load_weights` maps HF checkpoint names onto them.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from pyorch.distributed.communication_op import (
    fuse_all_reduce_rms_norm,
    tensor_model_parallel_all_reduce_rms_norm,
)
from pyorch.layers.activation import SiluAndMul, get_act_and_mul_fn
from pyorch.layers.attention import Attention
from pyorch.layers.fused_linear import (
    fused_decode_batch,
    linear_add_,
    linear_silu_and_mul,
    norm_linear,
    norm_mlp_add_,
    skinny_fusable,
)
from pyorch.layers.layernorm import RMSNorm
from pyorch.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pyorch.layers.quantization import QuantizationConfig
from pyorch.layers.quantization.utils.w8a8_utils import (
    Fp8Activation,
    rms_norm_fp8_input,
    silu_and_mul_fp8_input,
)
from pyorch.layers.rotary_embedding import get_rope, get_rope_params
from pyorch.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pyorch.models.utils import LLAMA_STACKED_PARAMS, load_stacked_weights


@dataclass(frozen=True)
class AttentionOptions:
    """Per-architecture attention details that differ within the Llama family."""

    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2: always; Llama: attention_bias)
    o_bias: bool = False  # bias on the output projection
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)


def get_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def get_layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The layer's sliding window, or None when it attends to the whole context. A window that
    covers max_position_embeddings is the same as none, so it is dropped."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # transformers v5: explicit per-layer attention kinds
        if layer_types[layer_idx] != "sliding_attention":
            return None
    elif getattr(config, "use_sliding_window", True) is False:  # Qwen2 v4 configs
        return None
    elif hasattr(config, "max_window_layers") and layer_idx < config.max_window_layers:
        return None
    if not window or window >= config.max_position_embeddings:
        return None
    return int(window)


class LlamaMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = get_act_and_mul_fn(hidden_act)
        self._silu_fused: bool | None = None  # tensor-parallel decode: silu in gate_up's GEMM

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:  # [T, hidden] -> same
        if isinstance(x, Fp8Activation):  # quantized by the norm before (rms_norm_fp8_input)
            return self.down_proj(self._act(self.gate_up_proj(x)))
        if self._silu_fused is None:  # after the weights are loaded: the first forward
            self._silu_fused = (self.gate_up_proj.tp_size > 1
                                and isinstance(self.act_fn, SiluAndMul)
                                and skinny_fusable(self.gate_up_proj, sharded_ok=True))
        if self._silu_fused and fused_decode_batch(x, self.gate_up_proj):
            # Tensor-parallel decode: the one-rank path fuses the whole layer
            # (LlamaDecoderLayer.forward_fused); here SiLU-and-mul joins gate_up's GEMM.
            return self.down_proj(linear_silu_and_mul(x, self.gate_up_proj))
        return self.down_proj(self._act(self.gate_up_proj(x)))

    def _act(
        self, gate_up: torch.Tensor,  # [T, 2 * intermediate / tp]
    ) -> torch.Tensor | Fp8Activation:  # [T, intermediate / tp]: down_proj's input
        """act(gate) * up; for SiLU in front of an fp8 down_proj that quantizes its input per
        token (more than FP8_SKINNY_MAX_TOKENS rows), that product quantized in the same kernel
        (silu_and_mul_fp8_input), the same bits as down_proj's own quantization."""
        if isinstance(self.act_fn, SiluAndMul):
            fp8_act = silu_and_mul_fp8_input(gate_up, self.down_proj)
            if fp8_act is not None:
                return fp8_act
        return self.act_fn(gate_up)


class LlamaAttention(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, options: AttentionOptions,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
    ):
        super().__init__()
        hidden_size = config.hidden_size
        self.head_dim = get_head_dim(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, config.num_attention_heads, num_kv_heads,
            bias=options.qkv_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, hidden_size, bias=options.o_bias,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )
        self.qk_norm = options.qk_norm
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        rope = get_rope_params(config)
        rotary_dim = int(self.head_dim * rope["partial_rotary_factor"])
        self.rotary_emb = get_rope(
            self.head_dim, rotary_dim, config.max_position_embeddings, rope["rope_theta"],
            rope if rope["rope_type"] != "default" else None, is_neox_style=True,
        )
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads,
            layer_idx=layer_idx, sliding_window=get_layer_sliding_window(config, layer_idx),
        )

    def attend(
        self,
        positions: torch.Tensor,  # [T] int64
        qkv: torch.Tensor,  # [T, q_size + 2 * kv_size]: qkv_proj's output
    ) -> torch.Tensor:  # [T, num_heads * head_dim]: o_proj's input
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # The attention layer normalizes (Qwen3) and rotates q and k in the kernel that writes
        # the KV cache.
        qk_norm = (self.q_norm, self.k_norm) if self.qk_norm else None
        return self.attn(q, k, v, positions=positions, rotary_emb=self.rotary_emb,
                         qk_norm=qk_norm)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        hidden_states: torch.Tensor | Fp8Activation,  # [T, hidden] (or quantized by the norm)
    ) -> torch.Tensor:  # [T, hidden]
        return self.o_proj(self.attend(positions, self.qkv_proj(hidden_states)))


# Builds a layer's MLP from (config, layer_idx, quant_config, prefix); the MoE models pass their
# sparse blocks here.
MlpFactory = Callable[[Any, int, QuantizationConfig | None, str], nn.Module]


def dense_mlp(
    config: Any, layer_idx: int, quant_config: QuantizationConfig | None = None,
    prefix: str = "",
) -> nn.Module:
    return LlamaMLP(
        config.hidden_size, config.intermediate_size, config.hidden_act,
        bias=getattr(config, "mlp_bias", False), quant_config=quant_config, prefix=prefix,
    )


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, options: AttentionOptions,
        make_mlp: MlpFactory = dense_mlp, quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.self_attn = LlamaAttention(
            config, layer_idx, options, quant_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = make_mlp(config, layer_idx, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Tensor parallel: o_proj's (and a dense MLP's down_proj's) all-reduce moves into the
        # next norm, one fused kernel (pyorch/distributed/communication_op.py). The MLP's output
        # then leaves this layer unreduced: `mlp_output_reduced` tells the model.
        self.attn_output_reduced = self.mlp_output_reduced = True
        if fuse_all_reduce_rms_norm():
            self.self_attn.o_proj.reduce_results = self.attn_output_reduced = False
            if isinstance(self.mlp, LlamaMLP):
                self.mlp.down_proj.reduce_results = self.mlp_output_reduced = False

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        hidden_states: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden], None before the first layer
        reduce_input: bool = False,  # hidden_states is the previous layer's unreduced MLP output
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each norm's output, or for an fp8 linear that quantizes its input per token (more than
        # FP8_SKINNY_MAX_TOKENS rows), that output quantized in the norm's kernel.
        normed: torch.Tensor | Fp8Activation
        fp8_input = None if reduce_input else rms_norm_fp8_input(
            self.input_layernorm, hidden_states, residual, self.self_attn.qkv_proj)
        if fp8_input is not None:
            normed, residual = fp8_input
        elif residual is None:
            residual = hidden_states
            normed = self.input_layernorm(hidden_states)
        else:
            normed, residual = _add_norm(
                self.input_layernorm, hidden_states, residual, reduce_input)
        hidden_states = self.self_attn(positions, normed)
        gate_up_proj = self.mlp.gate_up_proj if isinstance(self.mlp, LlamaMLP) else None
        fp8_input = None if not self.attn_output_reduced else rms_norm_fp8_input(
            self.post_attention_layernorm, hidden_states, residual, gate_up_proj)
        if fp8_input is not None:
            normed, residual = fp8_input
        else:
            normed, residual = _add_norm(
                self.post_attention_layernorm, hidden_states, residual,
                not self.attn_output_reduced)
        return self.mlp(normed), residual

    def fusable(self) -> bool:
        """Whether forward_fused can run this layer (see pyorch/layers/fused_linear.py)."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, LlamaMLP):  # a mixture-of-experts block
            return False
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return isinstance(mlp.act_fn, SiluAndMul) and all(map(skinny_fusable, linears))

    def forward_fused(
        self,
        positions: torch.Tensor,  # [T] int64
        residual: torch.Tensor,  # [T, hidden]: the residual stream, updated in place
    ) -> None:
        """The decode form of forward: norms, SiLU-and-mul and residual adds inside the GEMMs."""
        attn, mlp = self.self_attn, cast(LlamaMLP, self.mlp)
        qkv = norm_linear(residual, self.input_layernorm, attn.qkv_proj)
        linear_add_(residual, attn.attend(positions, qkv), attn.o_proj)
        norm_mlp_add_(residual, self.post_attention_layernorm, mlp.gate_up_proj, mlp.down_proj)


def _add_norm(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor, reduce: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """norm(x, residual), all-reducing x first (fused with the norm) when reduce."""
    if reduce:
        return tensor_model_parallel_all_reduce_rms_norm(x, residual, norm)
    return cast(tuple[torch.Tensor, torch.Tensor], norm(x, residual))


class LlamaModel(nn.Module):
    def __init__(
        self, config: Any, options: AttentionOptions, make_mlp: MlpFactory = dense_mlp,
        quant_config: QuantizationConfig | None = None, prefix: str = "model",
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config,
            prefix=f"{prefix}.embed_tokens",
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, options, make_mlp, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self._fusable: bool | None = None  # every layer can run forward_fused (checked once)

    @property
    def _decoder_layers(self) -> Sequence[LlamaDecoderLayer]:
        # self.layers holds only LlamaDecoderLayers; nn.ModuleList types its items as Module.
        return cast(Sequence[LlamaDecoderLayer], self.layers)

    def _fused_decode(self, hidden_states: torch.Tensor) -> bool:
        layers = self._decoder_layers
        if not layers:
            return False
        if self._fusable is None:  # after the weights are loaded: the first forward
            self._fusable = all(layer.fusable() for layer in layers)
        # Quantized layers (whatever their parameters) are not fusable: checked first.
        return self._fusable and fused_decode_batch(hidden_states, layers[0].self_attn.qkv_proj)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
    ) -> torch.Tensor:  # [T, hidden]
        hidden_states = self.embed_tokens(input_ids)
        if self._fused_decode(hidden_states):
            # The residual stream is hidden_states, updated in place.
            for layer in self._decoder_layers:
                layer.forward_fused(positions, hidden_states)
            return self.norm(hidden_states)
        residual = None
        unreduced = False  # the previous layer left its MLP output unreduced (fused norms)
        for layer in self._decoder_layers:
            hidden_states, residual = layer(positions, hidden_states, residual, unreduced)
            unreduced = not layer.mlp_output_reduced
        assert residual is not None  # a model has at least one layer
        hidden_states, _ = _add_norm(self.norm, hidden_states, residual, unreduced)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids, positions) -> hidden`, `compute_logits(hidden) -> logits` (float32),
    `load_weights(HF-named tensors)`. Build it under the target default dtype and device.
    quant_config (None: unquantized) gives each linear layer its method by its HF-style name
    (`model.layers.0.self_attn.qkv_proj`); the LM head and embeddings stay unquantized."""

    def __init__(
        self, config: Any, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ):
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.model = LlamaModel(
            config, self.attention_options(config), self.make_mlp, quant_config,
            prefix=f"{prefix}.model" if prefix else "model",
        )
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head"
        )
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_weights(self.model.embed_tokens)

    @classmethod
    def attention_options(cls, config: Any) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    @classmethod
    def make_mlp(
        cls, config: Any, layer_idx: int, quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> nn.Module:
        """The MLP of decoder layer `layer_idx`: dense here, sparse in the MoE models."""
        return dense_mlp(config, layer_idx, quant_config, prefix)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads HF checkpoint tensors; raises on unexpected or missing weights."""
        tied = getattr(self.config, "tie_word_embeddings", False)
        return load_stacked_weights(
            self, weights, LLAMA_STACKED_PARAMS, skip_prefixes=("lm_head.",) if tied else ()
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama with an optional sliding window (read from the config)."""
