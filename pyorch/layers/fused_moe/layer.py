"""FusedMoE: the experts of a mixture-of-experts block as two stacked weights (vLLM's layer).

w13_weight [E_local, 2 * I_shard, H] holds each expert's [gate; up] projections, w2_weight
[E_local, H, I_shard] its down projection. Two ways to split it over ranks, as in vLLM:
- tensor parallelism (`tp_size`/`tp_rank`): every rank holds every expert, I / tp_size columns
  of each, so its output is a partial sum;
- expert parallelism (`ep_size`/`ep_rank`, vLLM's `enable_expert_parallel`; the model passes
  tp_size=1 then): each rank holds whole experts, placed by `expert_placement_strategy`
  (`expert_placement`): "linear" gives rank r a contiguous range, "round_robin" the experts
  r, r + ep_size, ...; when E does not divide by ep_size the first E % ep_size ranks hold one
  more (vLLM's rule). `expert_map` (global -> local id, -1 elsewhere) makes the kernels skip the
  other ranks' experts, whose rows come out zero, so this rank's output is again a partial sum.
Every rank routes the same (replicated) tokens; the model all-reduces the partial sums (vLLM's
naive dispatch/combine without data parallelism). With tp_size = ep_size = 1 nothing is needed.
"""

import logging
from typing import cast

import torch
from torch import nn

from pyorch.layers.fused_moe.fused_moe import fused_experts, fused_topk, grouped_topk
from pyorch.layers.linear import set_weight_attrs
from pyorch.layers.quantization import (
    QuantizationConfig,
    QuantizeMethodBase,
    check_moe_unquantized,
    online_weight_device,
)

logger = logging.getLogger(__name__)
_logged_placement: set[tuple[int, int, int, str]] = set()  # one log line per layout a process


class FusedMoE(nn.Module):
    """forward(hidden_states [T, H], router_logits [T, E]) -> [T, H]: softmax routing to the
    top_k experts (renormalized when `renormalize`), SwiGLU experts, weighted sum.

    Grouped routing (vLLM's use_grouped_topk, DeepSeek-V2/V3): the experts form
    num_expert_group groups, the topk_group best groups are kept and the top_k experts taken
    among them; scoring_func "softmax" or "sigmoid", e_score_correction_bias [E] (the model's
    gate parameter, added for the choice only) and routed_scaling_factor (times the weights) as
    in vLLM's grouped_topk. Without use_grouped_topk only softmax scoring, no bias and a scaling
    factor of 1 exist (vLLM refuses the rest too)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool = True,
        params_dtype: torch.dtype | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        ep_size: int = 1,
        ep_rank: int = 0,
        use_grouped_topk: bool = False,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        scoring_func: str = "softmax",
        routed_scaling_factor: float = 1.0,
        e_score_correction_bias: torch.Tensor | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        expert_placement_strategy: str = "linear",
    ):
        super().__init__()
        if scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"FusedMoE: unsupported scoring_func {scoring_func!r} "
                             "(softmax or sigmoid)")
        if use_grouped_topk:
            if num_expert_group is None or topk_group is None:
                raise ValueError("FusedMoE: use_grouped_topk needs num_expert_group and topk_group")
            if num_experts % num_expert_group or not 1 <= topk_group <= num_expert_group or (
                    top_k > topk_group * (num_experts // num_expert_group)):
                raise ValueError(
                    f"FusedMoE: num_expert_group={num_expert_group} must divide num_experts="
                    f"{num_experts}, topk_group={topk_group} be in [1, num_expert_group] and "
                    f"top_k={top_k} at most topk_group * experts per group")
        elif (scoring_func != "softmax" or e_score_correction_bias is not None
              or routed_scaling_factor != 1.0):
            raise ValueError(
                "FusedMoE: scoring_func other than softmax, e_score_correction_bias and "
                "routed_scaling_factor need use_grouped_topk (as in vLLM)")
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.scoring_func = scoring_func
        self.routed_scaling_factor = routed_scaling_factor
        self.e_score_correction_bias = e_score_correction_bias
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"FusedMoE: top_k={top_k} must be in [1, num_experts={num_experts}]")
        if intermediate_size % tp_size:
            raise ValueError(
                f"FusedMoE: intermediate_size={intermediate_size} must divide by tp_size="
                f"{tp_size}"
            )
        if ep_size > num_experts:
            raise ValueError(f"FusedMoE: expert parallel size {ep_size} is larger than the "
                             f"number of experts ({num_experts}): a rank would hold none")
        if not (0 <= tp_rank < tp_size and 0 <= ep_rank < ep_size):
            raise ValueError(f"FusedMoE: tp_rank={tp_rank} / ep_rank={ep_rank} out of range")
        self.global_num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.renormalize = renormalize
        self.tp_size, self.tp_rank, self.ep_size, self.ep_rank = tp_size, tp_rank, ep_size, ep_rank
        self.expert_placement_strategy = expert_placement_strategy
        # Global ids of this rank's experts, in local order.
        self.local_expert_ids = expert_placement(num_experts, ep_size, ep_rank,
                                                 expert_placement_strategy)
        self._local_of = {e: i for i, e in enumerate(self.local_expert_ids)}
        self.local_num_experts = len(self.local_expert_ids)
        self.intermediate_size_per_partition = intermediate_size // tp_size
        if ep_size > 1:
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[self.local_expert_ids] = torch.arange(self.local_num_experts,
                                                             dtype=torch.int32)
            self.register_buffer("_expert_map", expert_map, persistent=False)
            layout = (num_experts, ep_size, ep_rank, expert_placement_strategy)
            if layout not in _logged_placement:
                _logged_placement.add(layout)
                logger.info("[EP rank %d/%d] expert parallelism (%s placement): %d of %d "
                            "experts local: %s", ep_rank, ep_size, expert_placement_strategy,
                            self.local_num_experts, num_experts, self.local_expert_ids)
        dtype = params_dtype or torch.get_default_dtype()
        e, i, h = self.local_num_experts, self.intermediate_size_per_partition, hidden_size
        # A quantized expert block gets its method's weights (fp8: Fp8MoEMethod); a method that
        # does not cover FusedMoE is refused, never run in the model dtype.
        self.quant_method: QuantizeMethodBase | None = None
        if quant_config is not None and not quant_config.is_layer_skipped(prefix):
            self.quant_method = quant_config.get_quant_method(self, prefix)
            if self.quant_method is None:
                check_moe_unquantized(quant_config, prefix)
        # The float expert weights (a serialized method replaces them in create_weights); on the
        # meta device for a method that quantizes them at load (online_weight_device).
        device = (online_weight_device()
                  if getattr(self.quant_method, "online_weights_meta", False) else None)
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device),
                                      requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            set_weight_attrs(param, {"weight_loader": self.weight_loader})
        if self.quant_method is not None:
            self.quant_method.create_weights(self, e, h, i, dtype)
        if self.quant_method is not None and use_grouped_topk:
            # The quantized methods route with softmax top-k: refuse rather than misroute.
            raise NotImplementedError(
                f"FusedMoE: use_grouped_topk with {type(self.quant_method).__name__} "
                "(quantized experts) is not supported yet")

    @property
    def expert_map(self) -> torch.Tensor | None:
        """[global_num_experts] int32: global expert id -> local id, -1 on other ranks; None
        without expert parallelism (every expert is local)."""
        return cast(torch.Tensor, self._expert_map) if self.ep_size > 1 else None

    def local_expert(self, expert_id: int) -> int | None:
        """The local index of a global expert id, or None when another rank holds it."""
        return self._local_of.get(expert_id)

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
    ) -> None:
        """Loads one expert's checkpoint matrix: shard_id "w1" (gate, [I, H]), "w3" (up, [I, H])
        or "w2" (down, [H, I]), vLLM's names; experts of other ranks are skipped and the
        intermediate dimension is narrowed to this rank's shard."""
        if shard_id not in ("w1", "w2", "w3"):
            raise ValueError(f"{weight_name}: shard_id must be w1, w2 or w3, got {shard_id!r}")
        local = self.local_expert(expert_id)
        if local is None:
            return
        i = self.intermediate_size_per_partition
        shard_dim = 1 if shard_id == "w2" else 0  # the intermediate dimension of the matrix
        full = loaded_weight.shape[shard_dim]
        if full != i * self.tp_size:
            raise ValueError(
                f"{weight_name}: intermediate size {full}, expected {i * self.tp_size}"
            )
        shard = loaded_weight.narrow(shard_dim, self.tp_rank * i, i)
        if shard_id == "w2":
            target = param.data[local]
        else:
            target = param.data[local].narrow(0, 0 if shard_id == "w1" else i, i)
        if target.shape != shard.shape:
            raise ValueError(
                f"{weight_name}: shape {tuple(loaded_weight.shape)} does not fit expert "
                f"weight {tuple(param.shape)} (shard {shard_id})"
            )
        target.copy_(shard)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, H]
        router_logits: torch.Tensor,  # [T, E]
    ) -> torch.Tensor:  # [T, H]
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden_states, router_logits)
        if self.use_grouped_topk:
            assert self.num_expert_group is not None and self.topk_group is not None
            topk_weights, topk_ids = grouped_topk(
                router_logits, self.top_k, self.renormalize, self.num_expert_group,
                self.topk_group, self.scoring_func, self.routed_scaling_factor,
                self.e_score_correction_bias,
            )
        else:
            topk_weights, topk_ids = fused_topk(router_logits, self.top_k, self.renormalize)
        return fused_experts(
            hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
            self.global_num_experts, self.expert_map,
        )

    def extra_repr(self) -> str:
        return (
            f"global_num_experts={self.global_num_experts}, local_num_experts="
            f"{self.local_num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
            f"intermediate_size_per_partition={self.intermediate_size_per_partition}, "
            f"renormalize={self.renormalize}, use_grouped_topk={self.use_grouped_topk}, "
            f"tp={self.tp_rank}/{self.tp_size}, "
            f"ep={self.ep_rank}/{self.ep_size}"
            + (f", placement={self.expert_placement_strategy}" if self.ep_size > 1 else "")
        )


def expert_placement(num_experts: int, ep_size: int, ep_rank: int,
                     strategy: str = "linear") -> list[int]:
    """The global expert ids rank ep_rank of ep_size holds (vLLM's determine_expert_map): the
    first num_experts % ep_size ranks hold one expert more; "linear" gives each rank a
    contiguous range, "round_robin" every ep_size-th expert from ep_rank."""
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"FusedMoE: ep_rank={ep_rank} out of range for ep_size={ep_size}")
    if strategy == "round_robin":
        return list(range(ep_rank, num_experts, ep_size))
    if strategy != "linear":
        raise ValueError(f"expert_placement_strategy {strategy!r} is not supported; use "
                         "linear or round_robin")
    base, extra = divmod(num_experts, ep_size)
    first = ep_rank * base + min(ep_rank, extra)
    return list(range(first, first + base + (1 if ep_rank < extra else 0)))
