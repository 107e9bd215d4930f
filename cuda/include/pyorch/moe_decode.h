// Mixture-of-experts: the decode kernel pair (few tokens) and the grouped top-k router (vLLM's
// fused_moe for small M and grouped_topk). M tokens, E experts, top_k experts per token,
// num_flat = M * top_k (token, expert) pairs, H hidden, I intermediate size.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// The most tokens fused_moe_decode takes (its down kernel keeps a row per token per warp in
// shared memory: 1 KiB per token).
constexpr int64_t kMoeDecodeMaxTokens = 128;
// The routing block sizes it is built for (moe_align_block_size's block_size): one or two n8
// tiles of pairs per expert block.
constexpr int64_t kMoeDecodeBlockSmall = 8;
constexpr int64_t kMoeDecodeBlockLarge = 16;

// out[t, :] = sum over the pairs f = t * top_k + j of topk_weights[f] * (act[f] @ w2[e]^T), with
// act[f, :] = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T) (rounded to the dtype, and written to act)
// and e = expert_ids[i / block_size] for f's entry i of sorted_token_ids (moe_align_block_size's
// output for this block_size); pairs of expert -1 or outside the sort contribute nothing. fp32
// sums, out rounded once. Two launches (PDL when pdl), graph safe.
//   out: [M, H]; act: [num_flat, I]; hidden_states: [M, H] (row stride hidden_stride);
//   w13: [E, 2I, H]; w2: [E, H, I]; topk_weights: [num_flat] fp32. fp16/bf16; H, I and the
//   stride multiples of 8; 16-byte aligned; M <= kMoeDecodeMaxTokens.
// The decode pair's launch shape, for sweeps (bench_moe_decode); a field at -1 takes the default.
struct MoeDecodeConfig {
  // gate_up's CTAs (4 warps each) resident per SM, through its register cap: 4 (128 registers
  // a thread, the skinny GEMM's), 6 (~80) or 8 (64): more CTAs in one wave, fewer loads each.
  int gate_up_ctas_per_sm = -1;
  // Warps of a down CTA (one CTA per 16 output columns): 16 (128 registers) or 32 (64), which
  // needs moe_decode_down_smem bytes of shared memory for M tokens (M <= 96 fits).
  int down_warps = -1;
  // Weight slices (16 rows x 128 k) each down warp asks of L2 under PDL before it waits on
  // gate_up: 0 .. 64 (only the first block of its run).
  int down_prefetch_slices = -1;
};

// The default launch shape for a batch of num_tokens over num_blocks routing blocks (the sort's
// worst-case count, expert_ids' length) of an expert with intermediate size inter: what
// fused_moe_decode runs when config is null. gate_up takes 8 CTAs per SM where that puts its
// whole grid in one wave and 4 would not (Qwen3-30B-A3B at one token: 768 CTAs), else 4; the
// down warps prefetch no weights at one or two tokens, 2 slices past that.
MoeDecodeConfig default_moe_decode_config(int64_t num_tokens, int64_t num_blocks, int64_t inter);

// Process-wide: default_moe_decode_config returns the picks from before the bench_moe_decode
// sweep (4 CTAs per SM, 16 down warps, 2 prefetched slices) for every batch. For A/B timing
// (PYORCH_MOE_DECODE_LEGACY_PICKS); set it before any CUDA graph is captured.
void set_moe_decode_legacy_picks(bool on);
bool moe_decode_legacy_picks();

cudaError_t fused_moe_decode(void* out, void* act, const void* hidden_states, const void* w13,
                             const void* w2, const float* topk_weights,
                             const int32_t* sorted_token_ids, const int32_t* expert_ids,
                             const int32_t* num_tokens_post_pad, DType dtype, int64_t num_tokens,
                             int64_t top_k, int64_t num_sorted, int64_t num_blocks,
                             int64_t num_experts, int64_t hidden, int64_t inter,
                             int64_t hidden_stride, int64_t block_size, bool pdl,
                             cudaStream_t stream, const MoeDecodeConfig* config = nullptr);

// Scoring of grouped_topk: softmax over the experts, or an independent sigmoid per expert.
enum class MoeScoring : int { kSoftmax = 0, kSigmoid = 1 };

// vLLM's grouped_topk (DeepSeek-V2/V3 routing). scores = softmax or sigmoid of gating [M, E] in
// fp32; choice = scores + bias (bias [E] fp32, or null: choice = scores). The E experts form
// num_groups groups of E / num_groups; a group's score is the max of its choices (the sum of
// its two largest with a bias); the topk_group best groups are kept and the top_k best choices
// among their experts are taken (ties to the lower id). topk_weights = scores of those experts,
// renormalized to sum 1 when renormalize, then times routed_scaling_factor.
//   topk_weights: [M, top_k] fp32; topk_ids: [M, top_k] int32/int64; gating: [M, E] (row stride
//   gating_stride) fp32/fp16/bf16; E <= 1024, num_groups <= 32, topk_group * E / num_groups >=
//   top_k.
cudaError_t grouped_topk(float* topk_weights, void* topk_ids, DType ids_dtype, const void* gating,
                         DType gating_dtype, const float* bias, int64_t num_tokens,
                         int64_t num_experts, int64_t top_k, int64_t num_groups, int64_t topk_group,
                         int64_t gating_stride, bool renormalize, MoeScoring scoring,
                         float routed_scaling_factor, cudaStream_t stream);

}  // namespace pyorch
