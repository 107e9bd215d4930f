"""Pure-PyTorch float64 references of the MoE ops (vLLM's semantics), computed token by token."""

import torch
import torch.nn.functional as F


def topk_softmax(gating: torch.Tensor, top_k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # weights [M, k] f64, ids [M, k] int64
    probs = torch.softmax(gating.double(), dim=-1)
    # Stable sort by descending probability: ties go to the lower expert id.
    ids = torch.sort(-probs, dim=-1, stable=True).indices[:, :top_k]
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def expert_gemm(input: torch.Tensor, weight: torch.Tensor, topk_weights: torch.Tensor | None,
                topk_ids: torch.Tensor, top_k: int, silu_and_mul: bool,
                expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """out[f] for every flat pair f = token * top_k + j of topk_ids [M, top_k] (float64):
    c = input[f // top_k] @ weight[e]^T, then SiLU-and-mul / routing weight; zeros for pairs
    whose expert maps to -1."""
    flat_ids = topk_ids.reshape(-1).long().cpu()
    n = weight.shape[1]
    out = torch.zeros(flat_ids.numel(), n // 2 if silu_and_mul else n, dtype=torch.float64)
    x = input.double().cpu()
    for e in flat_ids.unique().tolist():
        local = int(expert_map[e]) if expert_map is not None else e
        if local < 0:
            continue
        pairs = (flat_ids == e).nonzero().flatten()  # every pair routed to expert e
        c = x[pairs // top_k] @ weight[local].double().cpu().T  # [pairs, N]
        if silu_and_mul:
            c = F.silu(c[:, : n // 2]) * c[:, n // 2:]
        if topk_weights is not None:
            c = c * topk_weights.reshape(-1)[pairs].double().cpu().unsqueeze(1)
        out[pairs] = c
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:  # [M, H] float64
    top_k = topk_ids.shape[1]
    act = expert_gemm(x, w13, None, topk_ids, top_k, silu_and_mul=True)
    down = expert_gemm(act, w2, topk_weights, topk_ids, 1, silu_and_mul=False)
    return down.view(x.shape[0], top_k, down.shape[1]).sum(1)


def grouped_topk(gating: torch.Tensor, top_k: int, renormalize: bool, num_expert_group: int,
                 topk_group: int, scoring_func: str = "softmax",
                 routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # weights [M, k] f64, ids [M, k] int64
    """vLLM's grouped_topk in float64: group scores (max, or top-2 sum of the biased scores), the
    topk_group best groups, the top_k best (biased) scores among their experts; weights are the
    unbiased scores, renormalized, times routed_scaling_factor. Ties to the lower index."""
    logits = gating.double().cpu()
    scores = torch.softmax(logits, -1) if scoring_func == "softmax" else torch.sigmoid(logits)
    m, e = scores.shape
    choice = scores if e_score_correction_bias is None else (
        scores + e_score_correction_bias.double().cpu())
    grouped = choice.view(m, num_expert_group, e // num_expert_group)
    if e_score_correction_bias is None:
        group_scores = grouped.max(-1).values
    else:
        group_scores = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1)
    groups = torch.sort(-group_scores, dim=-1, stable=True).indices[:, :topk_group]
    keep = torch.zeros(m, num_expert_group, dtype=torch.bool).scatter_(1, groups, True)
    masked = choice.masked_fill(~keep.repeat_interleave(e // num_expert_group, 1), float("-inf"))
    ids = torch.sort(-masked, dim=-1, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * routed_scaling_factor, ids
