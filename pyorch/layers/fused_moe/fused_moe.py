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
    if _use_grouped_gemm(hidden_states, w13, w2):
        return fused_experts_grouped(hidden_states, w13, w2, topk_weights, topk_ids,
                                     global_num_experts, expert_map)
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
    del act  # before the output is allocated (see fused_experts_grouped)
    out = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    _ops.moe_sum(per_pair.view(num_tokens, top_k, hidden_size), out)
    return out


# ---- the decode path: few tokens, the weight stream ----------------------------------------------
# The decode kernel pair (fused_moe_decode: two launches, each a stream of the active experts'
# weights) serves batches of up to MOE_DECODE_MAX_TOKENS tokens (its kernel's limit) whose
# experts average at most MOE_DECODE_MAX_PAIRS_PER_EXPERT (token, expert) pairs; larger ones take
# the grouped GEMMs. Measured on an H100 (bench/results/NVIDIA_H100_80GB_HBM3/moe_crossover.json
# and moe_grouped_no_vllm.json): Mixtral (8 experts, top-2) decode pair 937 us at M = 32 (the
# floor), 1144 at M = 64 where the CUTLASS grouped path takes 1020; Qwen3-30B-A3B (128, top-8)
# 414 us at M = 64 against the grouped path's 446, 445 at M = 128. 8 pairs per expert draws the
# line between: M <= 32 on Mixtral, M <= 128 on Qwen3-30B-A3B.
MOE_DECODE_MAX_TOKENS = 128
MOE_DECODE_MAX_PAIRS_PER_EXPERT = 8


def moe_decode_block_size(num_tokens: int, top_k: int, num_experts: int) -> int | None:
    """The decode pair's routing block (8 or 16 pairs of one expert: one or two mma n8 tiles)
    for num_tokens, or None when the batch is past the decode pair's range. 16 once the experts
    average two pairs or more, so that an expert's weights are read by one block, not two."""
    if num_tokens > MOE_DECODE_MAX_TOKENS or (
            num_tokens * top_k > MOE_DECODE_MAX_PAIRS_PER_EXPERT * num_experts):
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
    routing = _single_token_routing(topk_ids, block_size, expert_map)
    if routing is None:
        routing = moe_align_block_size(topk_ids, block_size, global_num_experts, expert_map)
    sorted_ids, expert_ids, num_post_pad = routing
    dtype, device = hidden_states.dtype, hidden_states.device
    act = torch.empty(topk_ids.numel(), w2.shape[2], dtype=dtype, device=device)
    out = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    _ops.fused_moe_decode(
        out, act, hidden_states, w13, w2, topk_weights.float().contiguous(), sorted_ids,
        expert_ids, num_post_pad, block_size,
    )
    return out


# One token's routing needs no sort: its top_k experts are distinct, so block b of the decode pair
# can be pair b alone (entry 0 of the block; the other entries are padding) and expert_ids is
# topk_ids itself. sorted_token_ids and num_tokens_post_pad are then constants of top_k and the
# block size, made once per device outside any CUDA-graph capture: batch-1 decode skips
# moe_align_block_size's launch (9.4 us a layer on Qwen3-30B-A3B's 128 experts, H100).
_SINGLE_TOKEN_ROUTING: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _single_token_routing(
    topk_ids: torch.Tensor, block_size: int, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(sorted_token_ids, expert_ids, num_tokens_post_pad) of one token's top_k pairs, one pair
    per block, or None where moe_align_block_size must sort (several tokens, int64 ids, or a
    first call during a CUDA-graph capture, when the constants cannot be written)."""
    if topk_ids.shape[0] != 1 or topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        return None
    top_k, device = topk_ids.shape[1], topk_ids.device
    key = (top_k, block_size, device)
    consts = _SINGLE_TOKEN_ROUTING.get(key)
    if consts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        sorted_ids = torch.full((top_k, block_size), top_k, dtype=torch.int32)  # pad = num_flat
        sorted_ids[:, 0] = torch.arange(top_k, dtype=torch.int32)
        num_post_pad = torch.tensor([top_k * block_size], dtype=torch.int32)
        consts = (sorted_ids.view(-1).to(device), num_post_pad.to(device))
        _SINGLE_TOKEN_ROUTING[key] = consts
    expert_ids = topk_ids.view(-1)
    if expert_map is not None:  # global -> local ids, -1 (skipped) for other ranks' experts
        expert_ids = expert_map.index_select(0, expert_ids)
    return consts[0], expert_ids, consts[1]


# ---- the prefill path: permute, CUTLASS grouped GEMMs, un-permute --------------------------------
# From this many tokens on, CUDA bf16 layers past the decode pair's range take the grouped path.
GROUPED_GEMM_MIN_TOKENS = 64


def _use_grouped_gemm(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether fused_experts runs the prefill path (fused_experts_grouped): CUDA, bf16, at least
    GROUPED_GEMM_MIN_TOKENS tokens, sizes the TMA loads take, and a build with the kernel."""
    return (
        hidden_states.is_cuda
        and hidden_states.dtype == torch.bfloat16
        and hidden_states.shape[0] >= GROUPED_GEMM_MIN_TOKENS
        and w13.shape[1] % 16 == 0 and w13.shape[2] % 16 == 0 and w2.shape[2] % 16 == 0
        and w13.shape[0] <= 1024
        and _ops.moe_grouped_gemm_available()
    )


def fused_experts_grouped(
    hidden_states: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E_local, 2 * I, H]
    w2: torch.Tensor,  # [E_local, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float32
    topk_ids: torch.Tensor,  # [T, top_k] global expert ids
    global_num_experts: int,
    expert_map: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,  # [E_local] float32: fp8 weights' per-tensor scales
    w2_scale: torch.Tensor | None = None,
    a13_scale: torch.Tensor | None = None,  # [1] float32: static fp8 activation scales (else
    a2_scale: torch.Tensor | None = None,  # computed per tensor on the fly)
) -> torch.Tensor:  # [T, H], hidden_states' dtype
    """fused_experts over expert-sorted rows: gather the routed rows by expert
    (moe_grouped_permute), gate_up as one grouped GEMM (one problem per expert), SiLU-and-mul,
    down as a second grouped GEMM, and the routing-weighted sum back into token order
    (moe_grouped_unpermute). With fp8 weights (w13/w2 float8_e4m3fn and their per-expert scales)
    the activations are quantized per tensor on the fly and the GEMMs scale by activation scale
    x expert scale. Every size is a function of T only: CUDA-graph safe."""
    num_tokens, hidden_size = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_flat = num_tokens * top_k
    num_local, intermediate = w2.shape[0], w2.shape[2]
    dtype, device = hidden_states.dtype, hidden_states.device
    fp8 = w13.dtype == _ops.FP8_DTYPE
    if fp8 != (w13_scale is not None) or fp8 != (w2_scale is not None) or w2.dtype != w13.dtype:
        raise ValueError("fused_experts_grouped: fp8 weights (both) come with w13_scale and "
                         "w2_scale, bf16 weights without")
    if fp8 and dtype != torch.bfloat16:
        raise ValueError(f"fused_experts_grouped: fp8 experts take bfloat16 activations, got "
                         f"{dtype}")
    if num_tokens == 0:  # nothing routed (and no empty launch of the fp8 quantizers)
        return torch.empty(0, hidden_size, dtype=dtype, device=device)
    # Each intermediate is dropped as soon as the next one is made (`del`): the caching allocator
    # reuses its memory, so the layer's peak is two neighbouring buffers, not all six. At 16,384
    # tokens x top-8 (the memory profile's batch) on Qwen3-235B-A22B with EP=4 they hold 3.2 GB
    # together, the largest pair 1.3 GB; the difference goes to the KV cache.
    x, a1_scale = hidden_states, None
    if fp8:  # quantize before the gather: the permuted copy's rows are then already fp8
        x, a1_scale = _ops.scaled_fp8_quant(hidden_states, a13_scale)
    permuted = torch.empty(num_flat, hidden_size, dtype=x.dtype, device=device)
    offsets = torch.empty(num_local + 1, dtype=torch.int32, device=device)
    inv_perm = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    _ops.moe_grouped_permute(x, topk_ids, global_num_experts, expert_map, permuted, offsets,
                             inv_perm)
    del x
    # Rows past offsets[-1] (pairs of other ranks' experts) are never written by the GEMMs; zero
    # them where they exist so the fp8 per-tensor scale of the activation sees no stale memory.
    alloc = torch.zeros if expert_map is not None else torch.empty
    gate_up = alloc(num_flat, 2 * intermediate, dtype=dtype, device=device)
    _ops.moe_grouped_gemm(gate_up, permuted, w13, offsets,
                          a1_scale * w13_scale if fp8 else None)  # type: ignore[operator]
    del permuted
    act = torch.empty(num_flat, intermediate, dtype=dtype, device=device)
    _ops.silu_and_mul(act, gate_up)
    del gate_up
    a2, act_scale = act, None
    if fp8:
        a2, act_scale = _ops.scaled_fp8_quant(act, a2_scale)
    del act
    down = torch.empty(num_flat, hidden_size, dtype=dtype, device=device)
    _ops.moe_grouped_gemm(down, a2, w2, offsets,
                          act_scale * w2_scale if fp8 else None)  # type: ignore[operator]
    del a2
    out = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    _ops.moe_grouped_unpermute(down, inv_perm, topk_weights, out)
    return out
