// Instantiates the skinny GEMM for fp16 and bf16 behind the torch-free C API, and picks its launch
// configuration.
#include <atomic>

#include "gemm/skinny_gemm.cuh"
#include "pyorch/gemm.h"

namespace pyorch {

namespace {

std::atomic<bool> g_legacy_picks{false};  // set_skinny_gemm_legacy_picks

// The up-front L2 prefetch pays only under PDL, where it overlaps the previous kernel's tail:
// launched plainly, the fused decode layer ran 5.76-5.78 ms/token without it against 5.92 with
// one slice per warp (bench/results/NVIDIA_H100_80GB_HBM3/sweeps/:
// latency_sweep_small_grid_warps.txt, latency_sweep_no_prefetch.txt).
int default_prefetch_slices(int pdl) { return pdl > 0 ? 1 : 0; }

}  // namespace

// Picked from bench_gemm's sweep on an H100 with the weights read from a 2 GB span, as a model's
// are (bench/results/NVIDIA_H100_80GB_HBM3/skinny_gemm_tp_20261127/sweep_2gb.txt: Llama-3-8B and
// one rank's Llama-3-70B at TP=2/4/8, M = 1 / 8 / 16). An earlier sweep over 200 MB of copies
// (bench_gemm.txt) favoured the L2::256B hint and 4 warps on the large layers: there part of each
// weight was still in L2 from its last read, which never happens in a decode step. Times in us at
// M = 1, new pick against that earlier one:
// - >= 4096 blocks (an LM head): 16 warps, no hint (unchanged).
// - >= 768 blocks (the MLP's gate_up): 16 warps, no hint: 8B gate_up 79.9 against 87.0, TP=4
//   70B gate_up 83.0 against 86.5.
// - >= 512 blocks (TP o_proj / down of 70B): 8 warps, no hint (4 where K < 2048): TP=4 o_proj
//   14.1 against 14.7, TP=8 o_proj 8.3 against 9.0, TP=4 down 42.9 against 43.5.
// - fewer: 4 warps and the hint (the hint fetches a row's whole 256-byte slice segment per
//   request), 8 warps below 256 blocks with K >= 8192 (TP=4 qkv_proj 17.3): TP=2 qkv_proj 31.5
//   against 33.9 with 8, 8B down 41.9 against 43.5.
// Past 8 tokens the x fragments double and the hint stops paying: 4 warps without it, 8 from 512
// blocks with K >= 2048 or below 256 blocks with K >= 8192 (TP=8 qkv_proj at M = 16: 11.6 against
// 15.5). Deeper L2 prefetch (4 slices per warp) was slower on every shape. PDL is on wherever
// pdl_enabled(): the norm, activation, attention and cache kernels before the engine's GEMMs let
// them launch early, so the first weight slices are requested while those kernels finish.
// A normed input (norm_weight) changes the picks at M <= 8 (fused_sweep rows of
// skinny_gemm_tp_20261127/fused_sweep.txt): the per-slice norm math favours the L2 hint and fewer
// warps. 8 warps from 768 blocks or K >= 8192, else 4, always with the hint: the single-GPU
// decode's normed gate_up + SiLU 81.4 us against 82.1 with 16 warps and no hint (M = 8: 81.7
// against 83.6); a normed TP=4 o_proj 14.7 against 16.1 with 8 warps, no hint.
// NOTE(gemm): splitting K over a thread-block cluster (2-8 blocks per 16 rows, partials reduced
// through distributed shared memory) was measured on the tensor-parallel shapes and lost on every
// one: TP=4 Llama-3-70B qkv_proj 23.6 us at split 4 against 16.3 unsplit
// (bench/results/NVIDIA_H100_80GB_HBM3/skinny_gemm_tp_20261127/).
SkinnyGemmConfig default_skinny_gemm_config(int64_t num_tokens, int64_t output_size,
                                            int64_t input_size, bool normed) {
  if (g_legacy_picks.load(std::memory_order_relaxed)) {
    return legacy_skinny_gemm_config(num_tokens, output_size, input_size);
  }
  const int64_t num_blocks = (output_size + kernels::kSkinnyRows - 1) / kernels::kSkinnyRows;
  const bool few_long_rows = num_blocks < 256 && input_size >= 8192;
  SkinnyGemmConfig config;
  config.l2_prefetch = 0;
  if (num_blocks >= 4096) {
    config.num_warps = 16;
  } else if (num_tokens > kernels::kSkinnyTileTokens) {
    config.num_warps = few_long_rows || (num_blocks >= 512 && input_size >= 2048) ? 8 : 4;
  } else if (normed) {
    config.num_warps = num_blocks >= 768 || input_size >= 8192 ? 8 : 4;
    config.l2_prefetch = 1;
  } else if (num_blocks >= 768) {
    config.num_warps = 16;
  } else if (num_blocks >= 512) {
    config.num_warps = input_size >= 2048 ? 8 : 4;
  } else {
    config.num_warps = few_long_rows ? 8 : 4;
    config.l2_prefetch = 1;
  }
  config.pdl = pdl_enabled() ? 1 : 0;
  config.prefetch_slices = default_prefetch_slices(config.pdl);
  return config;
}

// The picks of the 200 MB-rotation sweep (bench_gemm.txt), before the 2 GB one.
SkinnyGemmConfig legacy_skinny_gemm_config(int64_t num_tokens, int64_t output_size,
                                           int64_t input_size) {
  const int64_t num_blocks = (output_size + kernels::kSkinnyRows - 1) / kernels::kSkinnyRows;
  SkinnyGemmConfig config;
  if (num_blocks >= 4096) {
    config.num_warps = 16;
    config.l2_prefetch = 0;
  } else if (num_tokens > kernels::kSkinnyTileTokens) {
    config.num_warps = 4;
    config.l2_prefetch = 0;
  } else {
    config.num_warps = input_size >= 8192 ? 8 : 4;
    config.l2_prefetch = 1;
  }
  config.pdl = pdl_enabled() ? 1 : 0;
  config.prefetch_slices = default_prefetch_slices(config.pdl);
  return config;
}

void set_skinny_gemm_legacy_picks(bool on) { g_legacy_picks.store(on, std::memory_order_relaxed); }

bool skinny_gemm_legacy_picks() { return g_legacy_picks.load(std::memory_order_relaxed); }

namespace {

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// M tiles: one n8 tile up to 8 tokens, two past that.
template <typename T, bool NORM, SkinnyGemmEpilogue EPI>
cudaError_t dispatch_m_tiles(const kernels::SkinnyGemmArgs<T>& args, const SkinnyGemmConfig& config,
                             cudaStream_t stream) {
  const bool l2 = config.l2_prefetch > 0;
  const bool pdl = config.pdl > 0;
  if (args.num_tokens <= kernels::kSkinnyTileTokens) {
    return kernels::launch_skinny_gemm_tiles<T, 1, NORM, EPI>(args, config.num_warps, l2, pdl,
                                                              stream);
  }
  return kernels::launch_skinny_gemm_tiles<T, 2, NORM, EPI>(args, config.num_warps, l2, pdl,
                                                            stream);
}

// The fused forms the engine uses: plain, normed [+ SiLU-and-mul], SiLU-and-mul, add.
template <typename T>
cudaError_t dispatch_epilogue(const kernels::SkinnyGemmArgs<T>& args, SkinnyGemmEpilogue epilogue,
                              const SkinnyGemmConfig& config, cudaStream_t stream) {
  using E = SkinnyGemmEpilogue;
  const bool norm = args.norm_weight != nullptr;
  switch (epilogue) {
    case E::kStore:
      return norm ? dispatch_m_tiles<T, true, E::kStore>(args, config, stream)
                  : dispatch_m_tiles<T, false, E::kStore>(args, config, stream);
    case E::kSiluMul:
      return norm ? dispatch_m_tiles<T, true, E::kSiluMul>(args, config, stream)
                  : dispatch_m_tiles<T, false, E::kSiluMul>(args, config, stream);
    case E::kAdd:
      if (norm) PYORCH_INVALID("skinny_gemm_fused: the add epilogue takes no norm");
      return dispatch_m_tiles<T, false, E::kAdd>(args, config, stream);
  }
  PYORCH_INVALID("skinny_gemm_fused: unknown epilogue %d", static_cast<int>(epilogue));
}

}  // namespace

namespace {

// Both entry points: checks, the launch configuration, the dtype. fused_pdl_default: the launch's
// PDL default is off (skinny_gemm_fused).
cudaError_t launch_skinny_gemm(void* out, const void* input, const void* weight, const void* bias,
                               const void* norm_weight, float eps, SkinnyGemmEpilogue epilogue,
                               DType dtype, int64_t num_tokens, int64_t output_size,
                               int64_t input_size, int64_t out_stride, int64_t input_stride,
                               cudaStream_t stream, const SkinnyGemmConfig* config,
                               bool fused_pdl_default) {
  static_assert(kSkinnyGemmMaxTokens == 2 * kernels::kSkinnyTileTokens, "two n8 tiles at most");
  if (num_tokens < 0 || num_tokens > kSkinnyGemmMaxTokens) {
    PYORCH_INVALID("skinny_gemm: num_tokens %lld outside [0, %lld]",
                   static_cast<long long>(num_tokens),
                   static_cast<long long>(kSkinnyGemmMaxTokens));
  }
  if (input_size % kernels::kSkinnyChunk != 0 || input_stride % kernels::kSkinnyChunk != 0) {
    PYORCH_INVALID("skinny_gemm: input_size %lld and input_stride %lld must be multiples of 8",
                   static_cast<long long>(input_size), static_cast<long long>(input_stride));
  }
  if (!aligned16(input) || !aligned16(weight) ||
      (norm_weight != nullptr && !aligned16(norm_weight))) {
    PYORCH_INVALID("skinny_gemm: input, weight and norm_weight must be 16-byte aligned");
  }
  if (epilogue == SkinnyGemmEpilogue::kSiluMul && output_size % 2 != 0) {
    PYORCH_INVALID("skinny_gemm: the SiLU-and-mul epilogue needs an even output_size, got %lld",
                   static_cast<long long>(output_size));
  }
  if (num_tokens == 0 || output_size == 0) return cudaSuccess;
  if (norm_weight != nullptr && input_size == 0) {
    PYORCH_INVALID("skinny_gemm: a normed input needs input_size > 0");
  }
  SkinnyGemmConfig cfg =
      default_skinny_gemm_config(num_tokens, output_size, input_size, norm_weight != nullptr);
  if (fused_pdl_default) cfg.pdl = 0;
  int prefetch_slices = -1;
  if (config != nullptr) {  // the caller's non-default fields win
    if (config->num_warps >= 0) cfg.num_warps = config->num_warps;
    if (config->l2_prefetch >= 0) cfg.l2_prefetch = config->l2_prefetch;
    // PDL only where it exists and is not turned off (set_pdl_enabled(false)).
    if (config->pdl >= 0) cfg.pdl = config->pdl > 0 && pdl_enabled() ? 1 : 0;
    prefetch_slices = config->prefetch_slices;
  }
  // The prefetch default follows the launch finally chosen.
  cfg.prefetch_slices = prefetch_slices >= 0 ? prefetch_slices : default_prefetch_slices(cfg.pdl);
  return PYORCH_DISPATCH_HALF_TYPES(dtype, T, [&] {
    kernels::SkinnyGemmArgs<T> args{};
    args.out = static_cast<T*>(out);
    args.input = static_cast<const T*>(input);
    args.weight = static_cast<const T*>(weight);
    args.bias = static_cast<const T*>(bias);
    args.norm_weight = static_cast<const T*>(norm_weight);
    args.eps = eps;
    args.num_tokens = num_tokens;
    args.output_size = output_size;
    args.input_size = input_size;
    args.out_stride = out_stride;
    args.input_stride = input_stride;
    args.prefetch_slices = cfg.prefetch_slices;
    PYORCH_RETURN_IF_ERROR(dispatch_epilogue<T>(args, epilogue, cfg, stream));
    return cudaGetLastError();
  });
}

}  // namespace

// NOTE(gemm): PDL off by default for the fused forms, measured on an H100 in the engine (batch-1
// decode, bench/results/NVIDIA_H100_80GB_HBM3/sweeps/latency_sweep_pdl.txt): the
// fused decode layer ran 6.65 ms/token with every kernel under PDL, 5.92 with the GEMMs launched
// plainly (the other kernels under PDL) and 5.94 with PDL off everywhere; the unfused layer
// 6.16 under PDL. Its GEMMs follow GEMMs (o_proj -> gate_up, down -> qkv), and an early-launched
// GEMM's resident, waiting blocks cost the one still streaming more than the launch they hide;
// neither dropping their L2 prefetch (6.52) nor triggering after the main loop (6.36, 6.25 with
// both) recovered it. The plain skinny_gemm keeps PDL: it follows the norm and activation
// kernels, whose short tails it hides (6.16 against 6.26 ms/token with PDL off everywhere).
cudaError_t skinny_gemm_fused(void* out, const void* input, const void* weight, const void* bias,
                              const void* norm_weight, float eps, SkinnyGemmEpilogue epilogue,
                              DType dtype, int64_t num_tokens, int64_t output_size,
                              int64_t input_size, int64_t out_stride, int64_t input_stride,
                              cudaStream_t stream, const SkinnyGemmConfig* config) {
  return launch_skinny_gemm(out, input, weight, bias, norm_weight, eps, epilogue, dtype, num_tokens,
                            output_size, input_size, out_stride, input_stride, stream, config,
                            /*fused_pdl_default=*/true);
}

cudaError_t skinny_gemm(void* out, const void* input, const void* weight, const void* bias,
                        DType dtype, int64_t num_tokens, int64_t output_size, int64_t input_size,
                        int64_t out_stride, int64_t input_stride, cudaStream_t stream,
                        const SkinnyGemmConfig* config) {
  return launch_skinny_gemm(out, input, weight, bias, nullptr, 0.f, SkinnyGemmEpilogue::kStore,
                            dtype, num_tokens, output_size, input_size, out_stride, input_stride,
                            stream, config, /*fused_pdl_default=*/false);
}

}  // namespace pyorch
