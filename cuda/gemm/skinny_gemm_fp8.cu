// Instantiates the skinny GEMM (gemm/skinny_gemm.cuh) for e4m3 weights behind the torch-free C
// API, pyorch::skinny_gemm_fp8 (pyorch/gemm.h): the same kernel, work split and fusions as the
// fp16/bf16 one, with the weight widened in registers and its scale applied in the epilogue.
#include <atomic>

#include <cuda_fp8.h>

#include "gemm/skinny_gemm.cuh"
#include "pyorch/gemm.h"

namespace pyorch {

namespace {

using Fp8 = __nv_fp8_e4m3;

// set_skinny_gemm_fp8_override: per form, the five SkinnyGemmConfig fields (-1: the pick).
std::atomic<int> g_override[kSkinnyFp8NumForms][5] = {
    {-1, -1, -1, -1, -1}, {-1, -1, -1, -1, -1}, {-1, -1, -1, -1, -1}, {-1, -1, -1, -1, -1}};

int form_of(bool normed, SkinnyGemmEpilogue epilogue) {
  if (epilogue == SkinnyGemmEpilogue::kAdd) return kSkinnyFp8Add;
  if (!normed) return kSkinnyFp8Plain;  // kStore, or kSiluMul without a norm (no engine path)
  return epilogue == SkinnyGemmEpilogue::kSiluMul ? kSkinnyFp8NormedSilu : kSkinnyFp8Normed;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T, bool NORM, SkinnyGemmEpilogue EPI>
cudaError_t fp8_dispatch_m_tiles(const kernels::SkinnyGemmArgs<T, Fp8>& args,
                                 const SkinnyGemmConfig& config, cudaStream_t stream) {
  const bool l2 = config.l2_prefetch > 0;
  const bool pdl = config.pdl > 0;
  if (args.num_tokens <= kernels::kSkinnyTileTokens) {
    return kernels::launch_skinny_gemm_tiles<T, 1, NORM, EPI>(args, config.num_warps, l2, pdl,
                                                              stream);
  }
  return kernels::launch_skinny_gemm_tiles<T, 2, NORM, EPI>(args, config.num_warps, l2, pdl,
                                                            stream);
}

template <typename T>
cudaError_t fp8_dispatch_epilogue(const kernels::SkinnyGemmArgs<T, Fp8>& args,
                                  SkinnyGemmEpilogue epilogue, const SkinnyGemmConfig& config,
                                  cudaStream_t stream) {
  using E = SkinnyGemmEpilogue;
  const bool norm = args.norm_weight != nullptr;
  switch (epilogue) {
    case E::kStore:
      return norm ? fp8_dispatch_m_tiles<T, true, E::kStore>(args, config, stream)
                  : fp8_dispatch_m_tiles<T, false, E::kStore>(args, config, stream);
    case E::kSiluMul:
      return norm ? fp8_dispatch_m_tiles<T, true, E::kSiluMul>(args, config, stream)
                  : fp8_dispatch_m_tiles<T, false, E::kSiluMul>(args, config, stream);
    case E::kAdd:
      if (norm) PYORCH_INVALID("skinny_gemm_fp8: the add epilogue takes no norm");
      return fp8_dispatch_m_tiles<T, false, E::kAdd>(args, config, stream);
  }
  PYORCH_INVALID("skinny_gemm_fp8: unknown epilogue %d", static_cast<int>(epilogue));
}

// Launch picks from bench_scaled_mm's fp8_skinny sweep on an H100, weights read from a 2 GB span
// as a decode step reads them (bench/results/NVIDIA_H100_80GB_HBM3/skinny_fp8_20261127/: Llama-3
// 8B and 70B projections, M = 1 / 8 / 16). The L2::256B hint lost everywhere but on the longest
// rows, and 8 warps beat 4 on most shapes; us at M = 1 against the picks this replaced (4 warps +
// hint, 8 from a bf16-equivalent K of 8192): 8B qkv 12.9 / 14.7, o_proj 7.7 / 9.7, down 23.5 /
// 26.1, gate_up 44.2 / 46.8 (4 warps: short rows in a large grid), 70B gate_up 167.5 / 190.2.
// - M <= 8: 8 warps, no hint; 4 where the rows are short (K <= 4096) and the grid large (>= 1024
//   blocks); the hint where rows are >= 16 KiB (70B down, K = 28672: 85.7 against 87.3 without).
// - M > 8: no hint; 4 warps where N >= 1.5 K (qkv, gate_up: 8B gate_up 49.2 against 50.7), else 8
//   (8B down 24.4 against 29.0).
// 16 warps were tried too (a separate e4m3 build): never more than 0.2% faster, so there is no
// 16-warp e4m3 form. set_skinny_gemm_legacy_picks restores the old picks, for A/B timing.
// The fused forms the engine's decode layer runs (a normed input, + SiLU-and-mul, the residual
// add) have their own picks, from the same bench's fused_sweep_us on an H100
// (bench/results/NVIDIA_H100_80GB_HBM3/skinny_fp8_fused_20261127/); us at M = 1 against the
// plain picks above:
// - M <= 8: the hint, which wins or ties in every fused form measured. A normed input: 4 warps
//   where the rows are short (K <= 4096) or the grid wide (N >= 4 K), else 8 (8B qkv 12.9 /
//   14.4, 8B gate_up 46.4 / 49.2, 70B qkv 34.8 / 37.0, 70B gate_up 163.4 / 177.8). The add: 8
//   warps (8B down 23.0 / 24.5, 70B o_proj 25.9 / 27.4).
// - M > 8: the plain picks, and the hint for the add where K >= 8192 (70B down 84.8 / 92.3, 8B
//   down 23.7 / 25.4; at K = 4096 it loses: 8B o_proj 9.6 / 9.0).
// PDL stays off in the fused forms: in the sweep it helped without the hint and hurt with it,
// and a chain of one kernel does not show what it does after the engine's other kernels.
SkinnyGemmConfig fp8_skinny_config(int64_t num_tokens, int64_t output_size, int64_t input_size,
                                   bool normed, SkinnyGemmEpilogue epilogue) {
  if (skinny_gemm_legacy_picks()) {
    // bf16 legacy picks on the bf16-equivalent K (an e4m3 row of K streams like a bf16 row of
    // K / 2), 16 warps capped to 8.
    SkinnyGemmConfig cfg = legacy_skinny_gemm_config(num_tokens, output_size, input_size / 2);
    if (cfg.num_warps > 8) cfg.num_warps = 8;
    if (normed || epilogue != SkinnyGemmEpilogue::kStore) cfg.pdl = 0;
    return cfg;
  }
  const int64_t num_blocks = (output_size + kernels::kSkinnyRows - 1) / kernels::kSkinnyRows;
  SkinnyGemmConfig cfg;
  cfg.l2_prefetch = 0;
  if (num_tokens > kernels::kSkinnyTileTokens) {
    cfg.num_warps = 2 * output_size >= 3 * input_size ? 4 : 8;
  } else {
    cfg.num_warps = num_blocks >= 1024 && input_size <= 4096 ? 4 : 8;
    cfg.l2_prefetch = input_size >= 16384 ? 1 : 0;
  }
  cfg.pdl = pdl_enabled() ? 1 : 0;
  if (!normed && epilogue == SkinnyGemmEpilogue::kStore) return cfg;
  cfg.pdl = 0;
  const bool add = epilogue == SkinnyGemmEpilogue::kAdd;
  // SiLU-and-mul without the norm was not in the sweep (no engine path runs it on fp8 weights:
  // pyorch/layers/fused_linear.py fuses fp8 layers of one rank only): the plain picks.
  if (!normed && !add) return cfg;
  if (num_tokens <= kernels::kSkinnyTileTokens) {
    cfg.l2_prefetch = 1;
    if (normed) cfg.num_warps = input_size <= 4096 || output_size >= 4 * input_size ? 4 : 8;
    if (add) cfg.num_warps = 8;
  } else if (add && input_size >= 8192) {
    cfg.l2_prefetch = 1;
  }
  return cfg;
}

}  // namespace

void set_skinny_gemm_fp8_override(int form, SkinnyGemmConfig config) {
  if (form < 0 || form >= kSkinnyFp8NumForms) return;
  g_override[form][0].store(config.num_warps, std::memory_order_relaxed);
  g_override[form][1].store(config.l2_prefetch, std::memory_order_relaxed);
  g_override[form][2].store(config.prefetch_slices, std::memory_order_relaxed);
  g_override[form][3].store(config.pdl, std::memory_order_relaxed);
  g_override[form][4].store(config.stage_x, std::memory_order_relaxed);
}

SkinnyGemmConfig skinny_gemm_fp8_override(int form) {
  SkinnyGemmConfig cfg;
  if (form < 0 || form >= kSkinnyFp8NumForms) return cfg;
  cfg.num_warps = g_override[form][0].load(std::memory_order_relaxed);
  cfg.l2_prefetch = g_override[form][1].load(std::memory_order_relaxed);
  cfg.prefetch_slices = g_override[form][2].load(std::memory_order_relaxed);
  cfg.pdl = g_override[form][3].load(std::memory_order_relaxed);
  cfg.stage_x = g_override[form][4].load(std::memory_order_relaxed);
  return cfg;
}

cudaError_t skinny_gemm_fp8(void* out, const void* input, const void* weight,
                            const float* weight_scale, bool weight_scale_per_channel,
                            const void* bias, const void* norm_weight, float eps,
                            SkinnyGemmEpilogue epilogue, DType dtype, int64_t num_tokens,
                            int64_t output_size, int64_t input_size, int64_t out_stride,
                            int64_t input_stride, cudaStream_t stream,
                            const SkinnyGemmConfig* config) {
  constexpr int64_t kElems = kernels::SkinnyWeight<__nv_bfloat16, Fp8>::kElems;
  if (num_tokens < 0 || num_tokens > kSkinnyGemmMaxTokens) {
    PYORCH_INVALID("skinny_gemm_fp8: num_tokens %lld outside [0, %lld]",
                   static_cast<long long>(num_tokens),
                   static_cast<long long>(kSkinnyGemmMaxTokens));
  }
  if (input_size % kElems != 0 || input_stride % kernels::kSkinnyChunk != 0) {
    PYORCH_INVALID(
        "skinny_gemm_fp8: input_size %lld must be a multiple of 16 and input_stride %lld of 8",
        static_cast<long long>(input_size), static_cast<long long>(input_stride));
  }
  if (!aligned16(input) || !aligned16(weight) ||
      (norm_weight != nullptr && !aligned16(norm_weight))) {
    PYORCH_INVALID("skinny_gemm_fp8: input, weight and norm_weight must be 16-byte aligned");
  }
  if (weight_scale == nullptr) PYORCH_INVALID("skinny_gemm_fp8: weight_scale is required");
  if (epilogue == SkinnyGemmEpilogue::kSiluMul && output_size % 2 != 0) {
    PYORCH_INVALID("skinny_gemm_fp8: the SiLU-and-mul epilogue needs an even output_size, got %lld",
                   static_cast<long long>(output_size));
  }
  if (num_tokens == 0 || output_size == 0) return cudaSuccess;
  if (norm_weight != nullptr && input_size == 0) {
    PYORCH_INVALID("skinny_gemm_fp8: a normed input needs input_size > 0");
  }
  SkinnyGemmConfig cfg =
      fp8_skinny_config(num_tokens, output_size, input_size, norm_weight != nullptr, epilogue);
  const SkinnyGemmConfig over = skinny_gemm_fp8_override(form_of(norm_weight != nullptr, epilogue));
  if (over.num_warps >= 0) cfg.num_warps = over.num_warps;
  if (over.l2_prefetch >= 0) cfg.l2_prefetch = over.l2_prefetch;
  if (over.pdl >= 0) cfg.pdl = over.pdl > 0 && pdl_enabled() ? 1 : 0;
  if (over.stage_x >= 0) cfg.stage_x = over.stage_x;
  int prefetch_slices = over.prefetch_slices;
  if (config != nullptr) {
    if (config->num_warps >= 0) cfg.num_warps = config->num_warps;
    if (config->l2_prefetch >= 0) cfg.l2_prefetch = config->l2_prefetch;
    if (config->pdl >= 0) cfg.pdl = config->pdl > 0 && pdl_enabled() ? 1 : 0;
    if (config->prefetch_slices >= 0) prefetch_slices = config->prefetch_slices;
    if (config->stage_x >= 0) cfg.stage_x = config->stage_x;
  }
  cfg.prefetch_slices = prefetch_slices >= 0 ? prefetch_slices : (cfg.pdl > 0 ? 1 : 0);
  return PYORCH_DISPATCH_HALF_TYPES(dtype, T, [&] {
    kernels::SkinnyGemmArgs<T, Fp8> args{};
    args.out = static_cast<T*>(out);
    args.input = static_cast<const T*>(input);
    args.weight = static_cast<const Fp8*>(weight);
    args.weight_scale = weight_scale;
    args.weight_scale_per_row = weight_scale_per_channel ? 1 : 0;
    args.bias = static_cast<const T*>(bias);
    args.norm_weight = static_cast<const T*>(norm_weight);
    args.eps = eps;
    args.num_tokens = num_tokens;
    args.output_size = output_size;
    args.input_size = input_size;
    args.out_stride = out_stride;
    args.input_stride = input_stride;
    args.prefetch_slices = cfg.prefetch_slices;
    args.stage_x =
        norm_weight != nullptr && num_tokens <= kernels::kSkinnyTileTokens && cfg.stage_x > 0 ? 1
                                                                                              : 0;
    PYORCH_RETURN_IF_ERROR(fp8_dispatch_epilogue<T>(args, epilogue, cfg, stream));
    return cudaGetLastError();
  });
}

}  // namespace pyorch
