"""The mixture-of-experts computation over pyorch's MoE ops (vLLM's fused_moe, functional form).

Route (topk_softmax, or grouped_topk for DeepSeek-style routers), sort the (token, expert) pairs
by expert (moe_align_block_size), run the gate_up GEMM with SiLU-and-mul fused and the down GEMM
with the routing weights in its epilogue (fused_moe_gemm, one launch each), and sum over top_k
(moe_sum). Batches of up to MOE_DECODE_MAX_TOKENS tokens take the decode kernel pair instead
(fused_moe_decode: gate_up, then a down GEMM that also applies the routing weights and sums over
top_k; two launches that stream each active expert's weights once). Every size is a function of
the number of tokens only, and nothing reads a device value on the host: the whole path is
CUDA-graph safe. Pure-PyTorch references live in tests/reference/moe.py.
"""

import torch

from pyorch import _ops

# Row tiles the CUDA expert GEMM is built for (cuda/moe/fused_moe_gemm.cuh); the CPU takes any.
MOE_BLOCK_SIZES = (16, 64)


def moe_block_size(num_flat: int, num_experts: int) -> int:
    """The row tile for num_flat (token, expert) pairs over num_experts experts: 16 while the
    experts average at most 16 rows each (decode: padding would waste most of a 64-row tile),
    else 64."""
    return 16 if num_flat <= 16 * num_experts else 64


def fused_topk(
    gating_output: torch.Tensor,  # [T, E] router logits
    top_k: int,
    renormalize: bool,
    indices_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, top_k] float32, ids [T, top_k]
    num_tokens = gating_output.shape[0]
    device = gating_output.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=indices_dtype, device=device)
    token_expert = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    _ops.topk_softmax(weights, ids, token_expert, gating_output, renormalize)
    return weights, ids


def grouped_topk(
    gating_output: torch.Tensor,  # [T, E] router logits
    top_k: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,  # [E]
    indices_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, top_k] float32, ids [T, top_k]
    """vLLM's grouped_topk (DeepSeek-V2/V3 routing) as one op; see _ops.grouped_topk."""
    num_tokens = gating_output.shape[0]
    device = gating_output.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=indices_dtype, device=device)
    bias = None if e_score_correction_bias is None else e_score_correction_bias.float().contiguous()
    _ops.grouped_topk(
        weights, ids, gating_output, num_expert_group, topk_group, renormalize, scoring_func,
        routed_scaling_factor, bias,
    )
    return weights, ids


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [T, top_k]
    block_size: int,
    num_experts: int,  # global expert count (topk_ids' range)
    expert_map: torch.Tensor | None = None,  # [num_experts] int32: global -> local id or -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids [max_padded], expert_ids [blocks], num_tokens_post_padded [1]) int32,
    sized by the worst case so that no device value is needed on the host."""
    num_flat = topk_ids.numel()
    max_padded = num_flat + min(num_experts, num_flat) * (block_size - 1)
    device = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(-(-max_padded // block_size), dtype=torch.int32, device=device)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=device)
    _ops.moe_align_block_size(
        topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_post_pad, expert_map
    )
    return sorted_ids, expert_ids, num_post_pad


def fused_experts(
    hidden_states: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E_local, 2 * I, H]: [gate; up] per expert
    w2: torch.Tensor,  # [E_local, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float32
    topk_ids: torch.Tensor,  # [T, top_k] global expert ids
    global_num_experts: int,
    expert_map: torch.Tensor | None = None,  # [global_num_experts] int32, -1 = not local
) -> torch.Tensor:  # [T, H]: sum_j topk_weights[t, j] * expert_{ids[t, j]}(hidden[t])
    decode_block = moe_decode_block_size(
        hidden_states.shape[0], topk_ids.shape[1], global_num_experts
    )
    if decode_block is not None:  # a few tokens: the decode kernel pair
        return fused_experts_decode(hidden_states, w13, w2, topk_weights, topk_ids,
                                    global_num_experts, expert_map, decode_block)
    num_tokens, hidden_size = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_flat = num_tokens * top_k
    intermediate = w2.shape[2]
    block = moe_block_size(num_flat, global_num_experts)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(
        topk_ids, block, global_num_experts, expert_map
    )
    dtype, device = hidden_states.dtype, hidden_states.device
    act = torch.empty(num_flat, intermediate, dtype=dtype, device=device)
    _ops.fused_moe_gemm(
        act, hidden_states, w13, None, sorted_ids, expert_ids, num_post_pad, top_k, block, True
    )
    per_pair = torch.empty(num_flat, hidden_size, dtype=dtype, device=device)
    _ops.fused_moe_gemm(
        per_pair, act, w2, topk_weights.reshape(-1), sorted_ids, expert_ids, num_post_pad, 1,
        block, False,
    )
    out = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    _ops.moe_sum(per_pair.view(num_tokens, top_k, hidden_size), out)
    return out


# ---- the decode path: few tokens, the weight stream ----------------------------------------------
# The decode kernel pair (fused_moe_decode: two launches, each a stream of the active experts'
# weights) serves batches of up to this many tokens; larger ones take the grouped GEMMs. The
# crossover, `python bench/moe_crossover.py` on an H100 (bench/results/NVIDIA_H100_80GB_HBM3/
# moe_crossover.json): the decode pair beats the mma.sync grouped GEMM up to M = 64 on Mixtral
# (1144 vs 1340 us; 1513 vs 1334 at 96) and up to 128 on Qwen3-30B-A3B (445 vs 520 us).
MOE_DECODE_MAX_TOKENS = 64


def moe_decode_block_size(num_tokens: int, top_k: int, num_experts: int) -> int | None:
    """The decode pair's routing block (8 or 16 pairs of one expert: one or two mma n8 tiles)
    for num_tokens, or None when the batch is past the decode pair's range. 16 once the experts
    average two pairs or more, so that an expert's weights are read by one block, not two."""
    if num_tokens > MOE_DECODE_MAX_TOKENS:
        return None
    return _decode_block(num_tokens * top_k, num_experts)


def _decode_block(num_flat: int, num_experts: int) -> int:
    return 16 if num_flat >= 2 * num_experts else 8


def fused_experts_decode(
    hidden_states: torch.Tensor,  # [T, H], T <= 128 on CUDA
    w13: torch.Tensor,  # [E_local, 2 * I, H]
    w2: torch.Tensor,  # [E_local, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float32
    topk_ids: torch.Tensor,  # [T, top_k] global expert ids
    global_num_experts: int,
    expert_map: torch.Tensor | None = None,
    block_size: int | None = None,  # 8 or 16; None: moe_decode_block_size's choice
) -> torch.Tensor:  # [T, H]
    """fused_experts through the decode kernel pair: sort, gate_up, down (+ weights + top-k sum)."""
    num_tokens, hidden_size = hidden_states.shape
    if block_size is None:
        block_size = _decode_block(topk_ids.numel(), global_num_experts)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(
        topk_ids, block_size, global_num_experts, expert_map
    )
    dtype, device = hidden_states.dtype, hidden_states.device
    act = torch.empty(topk_ids.numel(), w2.shape[2], dtype=dtype, device=device)
    out = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    _ops.fused_moe_decode(
        out, act, hidden_states, w13, w2, topk_weights.float().contiguous(), sorted_ids,
        expert_ids, num_post_pad, block_size,
    )
    return out
