// Between the C API of pyorch/scaled_mm.h (cuda/quantization/scaled_mm.cu: checks, tile choice)
// and the CUTLASS instantiations of each dtype family (scaled_mm_fp8.cu, scaled_mm_int8.cu,
// scaled_mm_blockwise.cu). Plain C++: no CUTLASS here, so scaled_mm.cu builds without it.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"
#include "pyorch/scaled_mm.h"

namespace pyorch::kernels {

// One checked call (see pyorch/scaled_mm.h for the meaning of each field).
struct ScaledMmParams {
  void* out;
  const void* a;
  const void* b;
  const float* a_scales;
  const float* b_scales;
  const void* bias;        // nullptr: none
  const int32_t* azp_adj;  // azp variant only
  const int32_t* azp;      // azp variant only; nullptr: per-tensor zero point
  DType out_dtype;
  int64_t m, n, k;
  int64_t out_stride, a_stride, b_stride;
  int64_t a_scales_stride;  // block-scaled only
  bool a_per_token;
  bool b_per_channel;
  const char* op;  // the C API function's name, for messages
};

// Each returns cudaErrorInvalidValue for a tile it does not instantiate.
cudaError_t launch_scaled_mm_fp8(const ScaledMmParams& p, ScaledMmTile tile, cudaStream_t stream);
// fp8 on the 128 x 256 tile (kHuge), in its own translation unit (scaled_mm_fp8_huge.cu).
cudaError_t launch_scaled_mm_fp8_huge(const ScaledMmParams& p, cudaStream_t stream);
// fp8 on the cooperative 128 x 128 and 256 x 128 tiles (kLargeCoop, kTall;
// scaled_mm_fp8_coop.cu).
cudaError_t launch_scaled_mm_fp8_coop(const ScaledMmParams& p, ScaledMmTile tile,
                                      cudaStream_t stream);
cudaError_t launch_scaled_mm_int8(const ScaledMmParams& p, ScaledMmTile tile, cudaStream_t stream);
cudaError_t launch_scaled_mm_azp(const ScaledMmParams& p, ScaledMmTile tile, cudaStream_t stream);
cudaError_t launch_scaled_mm_blockwise(const ScaledMmParams& p, cudaStream_t stream);

}  // namespace pyorch::kernels
