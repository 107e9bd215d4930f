"""What the mixture-of-experts decoders share: the sparse MLP block (router, FusedMoE experts,
optional gated shared expert) and the loading of per-expert checkpoint tensors into the stacked
expert weights. Mixtral, Qwen2-MoE and Qwen3-MoE are the Llama decoder with this block as MLP."""

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pyorch.distributed.communication_op import tensor_model_parallel_all_reduce
from pyorch.distributed.parallel_state import (
    get_expert_parallel_rank_and_size,
    get_expert_placement_strategy,
)
from pyorch.layers.fused_moe import FusedMoE
from pyorch.layers.linear import ReplicatedLinear, get_tensor_model_parallel_rank_and_size
from pyorch.layers.quantization import QuantizationConfig
from pyorch.models.llama import LlamaMLP
from pyorch.models.utils import LLAMA_STACKED_PARAMS, load_stacked_weights

# HF per-expert names -> vLLM's shard ids (w1 gate, w3 up, w2 down).
_EXPERT_SHARDS = {
    "w1": "w1", "w3": "w3", "w2": "w2", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",
}
# <prefix>.experts.<id>.<proj>.weight (every release's checkpoint layout), and an fp8
# checkpoint's per-expert .weight_scale / .input_scale beside it.
_PER_EXPERT = re.compile(
    r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale|input_scale)$")
# <prefix>.experts.gate_up_proj [E, 2I, H] / .down_proj [E, H, I] (transformers v5 in memory).
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


class SparseMoeBlock(nn.Module):
    """x [T, H] -> sum of the top_k experts' SwiGLU outputs, weighted by the softmax router, plus
    sigmoid(shared_expert_gate(x)) * shared_expert(x) when the model has a shared expert."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        hidden_act: str = "silu",
        shared_expert_intermediate_size: int = 0,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"MoE experts support hidden_act='silu' only, got {hidden_act!r}")
        # The router stays unquantized, as in vLLM (quant_config=None for the gate).
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, prefix=f"{prefix}.gate")
        # Tensor parallelism shards every expert's intermediate dimension; expert parallelism
        # (enable_expert_parallel) gives each rank whole experts instead. Either way each rank's
        # expert output is a partial sum, all-reduced before the (already reduced, tensor-
        # parallel) shared expert adds.
        tp_rank, self.tp_size = get_tensor_model_parallel_rank_and_size()
        # A quantization method that does not cover the experts is refused there.
        ep_rank, ep_size = get_expert_parallel_rank_and_size()
        if ep_size > 1:
            self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size,
                                    renormalize, ep_size=ep_size, ep_rank=ep_rank,
                                    expert_placement_strategy=get_expert_placement_strategy(),
                                    quant_config=quant_config, prefix=f"{prefix}.experts")
        else:
            self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size,
                                    renormalize, tp_size=self.tp_size, tp_rank=tp_rank,
                                    quant_config=quant_config, prefix=f"{prefix}.experts")
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if shared_expert_intermediate_size > 0:
            self.shared_expert = LlamaMLP(
                hidden_size, shared_expert_intermediate_size, hidden_act, bias=False,
                quant_config=quant_config, prefix=f"{prefix}.shared_expert",
            )
            self.shared_expert_gate = ReplicatedLinear(
                hidden_size, 1, bias=False, prefix=f"{prefix}.shared_expert_gate"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        out = self.experts(x, self.gate(x))
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def check_softmax_routing(config: Any) -> None:
    """Raises for a config that asks for routing these models' softmax top-k router does not do:
    DeepSeek-style grouped top-k (n_group / topk_group), sigmoid scoring, a score-correction
    bias (topk_method noaux_tc) or a routed scaling factor. FusedMoE has them
    (use_grouped_topk=...), but Mixtral / Qwen-MoE blocks would silently ignore them."""
    asked = {
        key: getattr(config, key) for key in ("n_group", "topk_group", "num_expert_group")
        if (getattr(config, key, None) or 1) > 1
    }
    if getattr(config, "scoring_func", "softmax") not in (None, "softmax"):
        asked["scoring_func"] = config.scoring_func
    if getattr(config, "topk_method", None) not in (None, "greedy"):
        asked["topk_method"] = config.topk_method
    if getattr(config, "routed_scaling_factor", None) not in (None, 1, 1.0):
        asked["routed_scaling_factor"] = config.routed_scaling_factor
    if asked:
        raise ValueError(
            f"{type(config).__name__}: routing options {asked} are not supported by this "
            "architecture's router (softmax top-k); DeepSeek-style grouped routing needs a "
            "model that passes them to FusedMoE(use_grouped_topk=...)")


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Qwen-MoE placement: sparse unless listed in mlp_only_layers or off decoder_sparse_step."""
    if layer_idx in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return getattr(config, "num_experts", 0) > 0 and (layer_idx + 1) % step == 0


def load_moe_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: tuple[str, str] | None = None,
    skip_prefixes: tuple[str, ...] = (),
) -> set[str]:
    """load_stacked_weights for an MoE model: per-expert tensors go to their FusedMoE (whose
    loader places them in w13_weight / w2_weight); `rename` maps an HF module name onto ours
    (Mixtral's block_sparse_moe -> mlp). Raises KeyError for missing or unexpected experts."""
    moe_layers = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    expected = {
        (name, e, shard): False
        for name, layer in moe_layers.items()
        for e in range(layer.global_num_experts) if layer.local_expert(e) is not None
        for shard in ("w1", "w2", "w3")
    }
    loaded: set[str] = set()

    def load_expert(prefix: str, hf_name: str, expert_id: int, shard: str, t: torch.Tensor,
                    kind: str = "weight") -> None:
        layer = moe_layers.get(prefix)
        if layer is None or not 0 <= expert_id < layer.global_num_experts:
            raise KeyError(f"Unexpected weight {hf_name!r} in the checkpoint: no such expert")
        # weight -> w13_weight / w2_weight; weight_scale -> w13_weight_scale / ...
        name = f"{'w2' if shard == 'w2' else 'w13'}_{kind}"
        param = getattr(layer, name, None)
        if not isinstance(param, nn.Parameter):
            raise KeyError(f"Unexpected weight {hf_name!r} in the checkpoint: {prefix} has no "
                           f"{name} (is the checkpoint quantized differently?)")
        getattr(param, "weight_loader", layer.weight_loader)(param, t, hf_name, shard, expert_id)
        if kind == "weight" and layer.local_expert(expert_id) is not None:
            expected[(prefix, expert_id, shard)] = True
        loaded.add(f"{prefix}.{name}")

    def others() -> Iterable[tuple[str, torch.Tensor]]:
        for hf_name, tensor in weights:
            name = hf_name.replace(*rename) if rename else hf_name
            per_expert = _PER_EXPERT.match(name)
            stacked = _STACKED_EXPERTS.match(name)
            if per_expert:
                prefix, expert_id, proj, kind = per_expert.groups()
                load_expert(prefix, hf_name, int(expert_id), _EXPERT_SHARDS[proj], tensor, kind)
            elif stacked and stacked.group(1) in moe_layers:
                prefix, proj = stacked.groups()
                for e in range(tensor.shape[0]):
                    if proj == "down_proj":
                        load_expert(prefix, hf_name, e, "w2", tensor[e])
                    else:
                        gate, up = tensor[e].chunk(2, dim=0)
                        load_expert(prefix, hf_name, e, "w1", gate)
                        load_expert(prefix, hf_name, e, "w3", up)
            else:
                yield name, tensor

    expert_prefixes = tuple(name + "." for name in moe_layers)
    loaded |= load_stacked_weights(
        model, others(), LLAMA_STACKED_PARAMS, skip_prefixes=skip_prefixes + expert_prefixes
    )
    missing = [f"{p}.{e}.{s}" for (p, e, s), done in expected.items() if not done]
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10
                                           else "")
        raise KeyError(f"Checkpoint is missing expert weights for: {shown}")
    return loaded
