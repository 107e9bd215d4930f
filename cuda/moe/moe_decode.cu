// Instantiates the decode MoE kernel pair and grouped_topk behind pyorch/moe_decode.h.
#include <atomic>

#include "moe/grouped_topk.cuh"
#include "moe/moe_decode.cuh"
#include "pyorch/moe_decode.h"

namespace pyorch {

namespace {
std::atomic<bool> g_moe_decode_legacy_picks{false};
}  // namespace

void set_moe_decode_legacy_picks(bool on) {
  g_moe_decode_legacy_picks.store(on, std::memory_order_relaxed);
}

bool moe_decode_legacy_picks() { return g_moe_decode_legacy_picks.load(std::memory_order_relaxed); }

// NOTE(moe_decode): picks from bench_moe_decode on an H200 (bench/results/NVIDIA_H200/
// moe_decode_picks_20261129/), the pair timed with a fresh routing per call and PDL on.
// Qwen3-30B-A3B at one token: 32.3 us with the old picks, 29.7 with 8 gate_up CTAs per SM and
// no down prefetch (each alone: 31.0 and 30.8); at two tokens no prefetch 47.5 against 48.3 and
// 8 CTAs per SM slower (50.1: 1536 CTAs, 1.45 waves either way); at four and more tokens, and on
// Mixtral past one token, the old picks were the best or within 1%. Mixtral at one token: 177.9
// us without the prefetch against 182.9.
MoeDecodeConfig default_moe_decode_config(int64_t num_tokens, int64_t num_blocks, int64_t inter) {
  MoeDecodeConfig cfg{4, kernels::kMoeDecodeDownWarps, kernels::kMoeDecodeDownPrefetchSlices};
  if (moe_decode_legacy_picks()) return cfg;
  if (num_tokens <= 2) cfg.down_prefetch_slices = 0;
  const int sms = current_device_sm_count();
  const int64_t grid =
      num_blocks * ((inter + kernels::kSkinnyRows / 2 - 1) / (kernels::kSkinnyRows / 2));
  if (sms > 0 && grid > 4LL * sms && grid <= 8LL * sms) cfg.gate_up_ctas_per_sm = 8;
  return cfg;
}

cudaError_t fused_moe_decode(void* out, void* act, const void* hidden_states, const void* w13,
                             const void* w2, const float* topk_weights,
                             const int32_t* sorted_token_ids, const int32_t* expert_ids,
                             const int32_t* num_tokens_post_pad, DType dtype, int64_t num_tokens,
                             int64_t top_k, int64_t num_sorted, int64_t num_blocks,
                             int64_t num_experts, int64_t hidden, int64_t inter,
                             int64_t hidden_stride, int64_t block_size, bool pdl,
                             cudaStream_t stream, const MoeDecodeConfig* config) {
  if (hidden % 8 != 0 || inter % 8 != 0 || hidden_stride % 8 != 0 || top_k < 1 ||
      num_tokens > kMoeDecodeMaxTokens) {
    PYORCH_INVALID(
        "fused_moe_decode: hidden, intermediate size and row stride must be multiples of 8, "
        "top_k >= 1 and at most %d tokens",
        static_cast<int>(kMoeDecodeMaxTokens));
  }
  MoeDecodeConfig cfg = default_moe_decode_config(num_tokens, num_blocks, inter);
  if (config != nullptr) {
    if (config->gate_up_ctas_per_sm >= 0) cfg.gate_up_ctas_per_sm = config->gate_up_ctas_per_sm;
    if (config->down_warps >= 0) cfg.down_warps = config->down_warps;
    if (config->down_prefetch_slices >= 0) cfg.down_prefetch_slices = config->down_prefetch_slices;
  }
  if (cfg.down_prefetch_slices > 64) {
    PYORCH_INVALID("fused_moe_decode: down_prefetch_slices must be in [0, 64], got %d",
                   cfg.down_prefetch_slices);
  }
  if (cfg.gate_up_ctas_per_sm != 4 && cfg.gate_up_ctas_per_sm != 6 &&
      cfg.gate_up_ctas_per_sm != 8) {
    PYORCH_INVALID("fused_moe_decode: gate_up_ctas_per_sm must be 4, 6 or 8, got %d",
                   cfg.gate_up_ctas_per_sm);
  }
  if (cfg.down_warps != 16 && cfg.down_warps != 32) {
    PYORCH_INVALID("fused_moe_decode: down_warps must be 16 or 32, got %d", cfg.down_warps);
  }
  const int64_t m_tiles = block_size / 8;
  const size_t down_smem = cfg.down_warps == 32
                               ? (m_tiles == 1 ? kernels::moe_decode_down_smem<1, 32>(num_tokens)
                                               : kernels::moe_decode_down_smem<2, 32>(num_tokens))
                               : 0;
  if (down_smem > kernels::kMoeDecodeMaxDownSmem) {
    PYORCH_INVALID(
        "fused_moe_decode: 32 down warps need %zu bytes of shared memory for %lld "
        "tokens (at most %zu)",
        down_smem, static_cast<long long>(num_tokens), kernels::kMoeDecodeMaxDownSmem);
  }
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  const int ctas = cfg.gate_up_ctas_per_sm == 4 ? 0 : cfg.gate_up_ctas_per_sm;
  return PYORCH_DISPATCH_HALF_TYPES(dtype, T, [&]() -> cudaError_t {
    const kernels::MoeDecodeParams<T> p{static_cast<T*>(out),
                                        static_cast<T*>(act),
                                        static_cast<const T*>(hidden_states),
                                        static_cast<const T*>(w13),
                                        static_cast<const T*>(w2),
                                        topk_weights,
                                        sorted_token_ids,
                                        expert_ids,
                                        num_tokens_post_pad,
                                        cfg.down_prefetch_slices,
                                        num_tokens,
                                        num_tokens * top_k,
                                        num_sorted,
                                        num_blocks,
                                        num_experts,
                                        top_k,
                                        hidden,
                                        inter,
                                        hidden_stride};
    switch (block_size) {
      case kMoeDecodeBlockSmall:
        return kernels::launch_moe_decode<T, 1>(p, ctas, cfg.down_warps, pdl, stream);
      case kMoeDecodeBlockLarge:
        return kernels::launch_moe_decode<T, 2>(p, ctas, cfg.down_warps, pdl, stream);
      default:
        PYORCH_INVALID("fused_moe_decode: unsupported block_size %lld (8 or 16)",
                       static_cast<long long>(block_size));
    }
  });
}

cudaError_t grouped_topk(float* topk_weights, void* topk_ids, DType ids_dtype, const void* gating,
                         DType gating_dtype, const float* bias, int64_t num_tokens,
                         int64_t num_experts, int64_t top_k, int64_t num_groups, int64_t topk_group,
                         int64_t gating_stride, bool renormalize, MoeScoring scoring,
                         float routed_scaling_factor, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > kernels::kGroupedTopkMaxExperts || num_groups < 1 ||
      num_groups > 32 || num_experts % num_groups != 0 || topk_group < 1 ||
      topk_group > num_groups || top_k < 1 || top_k > 32 ||
      top_k > topk_group * (num_experts / num_groups)) {
    PYORCH_INVALID(
        "grouped_topk: need E <= %d divisible by num_expert_group <= 32, 1 <= topk_group <= "
        "num_expert_group and 1 <= top_k <= min(32, topk_group * E / num_expert_group)",
        kernels::kGroupedTopkMaxExperts);
  }
  if (num_tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((num_tokens + kernels::kGroupedTopkWarps - 1) /
                                        kernels::kGroupedTopkWarps));
  const int threads = kernels::kGroupedTopkWarps * kernels::kWarpSize;
  return PYORCH_DISPATCH_FLOAT_TYPES(gating_dtype, T, [&]() -> cudaError_t {
    const T* g = static_cast<const T*>(gating);
    const int m = static_cast<int>(num_tokens), e = static_cast<int>(num_experts);
    const int k = static_cast<int>(top_k), ng = static_cast<int>(num_groups);
    const int tg = static_cast<int>(topk_group);
    if (ids_dtype == DType::kInt32) {
      kernels::grouped_topk_kernel<T, int32_t><<<grid, threads, 0, stream>>>(
          topk_weights, static_cast<int32_t*>(topk_ids), g, bias, m, e, k, ng, tg, gating_stride,
          renormalize, scoring, routed_scaling_factor);
    } else if (ids_dtype == DType::kInt64) {
      kernels::grouped_topk_kernel<T, int64_t><<<grid, threads, 0, stream>>>(
          topk_weights, static_cast<int64_t*>(topk_ids), g, bias, m, e, k, ng, tg, gating_stride,
          renormalize, scoring, routed_scaling_factor);
    } else {
      PYORCH_INVALID("grouped_topk: topk_ids must be int32 or int64");
    }
    return cudaGetLastError();
  });
}

}  // namespace pyorch
