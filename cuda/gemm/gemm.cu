// Instantiates the skinny GEMM for fp16 and bf16 behind the torch-free C API, and picks its launch
// configuration.
#include "gemm/skinny_gemm.cuh"
#include "pyorch/gemm.h"

namespace pyorch {

SkinnyGemmConfig default_skinny_gemm_config(int64_t num_tokens, int64_t output_size,
                                            int64_t input_size) {
  (void)output_size;
  (void)input_size;
  SkinnyGemmConfig config;
  config.num_warps = 8;
  // Two slices in flight per warp cost ~2x the registers; past 8 tokens the x fragments double.
  config.unroll = num_tokens <= kernels::kSkinnyTileTokens ? 2 : 1;
  config.l2_prefetch = 0;
  config.pdl = 1;
  return config;
}

namespace {

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T>
cudaError_t launch_skinny_gemm(const kernels::SkinnyGemmArgs<T>& args,
                               const SkinnyGemmConfig& config, cudaStream_t stream) {
  const bool l2 = config.l2_prefetch > 0;
  const bool pdl = config.pdl > 0;
  if (args.num_tokens <= kernels::kSkinnyTileTokens) {
    return kernels::launch_skinny_gemm_tiles<T, 1>(args, config.num_warps, config.unroll, l2, pdl,
                                                   stream);
  }
  return kernels::launch_skinny_gemm_tiles<T, 2>(args, config.num_warps, config.unroll, l2, pdl,
                                                 stream);
}

}  // namespace

cudaError_t skinny_gemm(void* out, const void* input, const void* weight, const void* bias,
                        DType dtype, int64_t num_tokens, int64_t output_size, int64_t input_size,
                        int64_t out_stride, int64_t input_stride, cudaStream_t stream,
                        const SkinnyGemmConfig* config) {
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
  if (!aligned16(input) || !aligned16(weight)) {
    PYORCH_INVALID("skinny_gemm: input and weight must be 16-byte aligned");
  }
  if (num_tokens == 0 || output_size == 0) return cudaSuccess;
  SkinnyGemmConfig cfg = default_skinny_gemm_config(num_tokens, output_size, input_size);
  if (config != nullptr) {  // the caller's non-default fields win
    if (config->num_warps > 0) cfg.num_warps = config->num_warps;
    if (config->unroll > 0) cfg.unroll = config->unroll;
    if (config->l2_prefetch >= 0) cfg.l2_prefetch = config->l2_prefetch;
    if (config->pdl >= 0) cfg.pdl = config->pdl;
  }
  return PYORCH_DISPATCH_HALF_TYPES(dtype, T, [&] {
    const kernels::SkinnyGemmArgs<T> args{
        static_cast<T*>(out),         static_cast<const T*>(input), static_cast<const T*>(weight),
        static_cast<const T*>(bias),  num_tokens,                   output_size,
        input_size,                   out_stride,                   input_stride};
    PYORCH_RETURN_IF_ERROR(launch_skinny_gemm<T>(args, cfg, stream));
    return cudaGetLastError();
  });
}

}  // namespace pyorch
