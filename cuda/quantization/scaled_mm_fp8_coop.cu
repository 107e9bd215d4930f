// fp8 e4m3 x fp8 e4m3 -> bf16 / fp16 on cooperative tiles with fp8 fast accumulation, clusters of
// 2 along m: 128 x 128 x 128 (kLargeCoop: both consumer warp groups on one tile, where the
// ping-pong kLarge gives each its own) and 256 x 128 x 128 (kTall: 128 rows per warp group, the
// B tile read once for twice the rows). Candidates for the prefill sizes (m >= 1024), timed
// against the ping-pong and 128 x 256 tiles by `bench_scaled_mm --sweep-tiles`. Their own file, so
// the other fp8 tiles need not recompile.
#ifdef PYORCH_WITH_CUTLASS

#include "quantization/scaled_mm_sm90.cuh"

namespace pyorch::kernels {

namespace {

using cutlass::epilogue::TmaWarpSpecializedCooperative;
using cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;

using TileLargeCoop =
    Sm90Tile<Shape<_128, _128, _128>, Shape<_2, _1, _1>,
             KernelTmaWarpSpecializedCooperativeFP8FastAccum, TmaWarpSpecializedCooperative, false>;
using TileTall =
    Sm90Tile<Shape<_256, _128, _128>, Shape<_2, _1, _1>,
             KernelTmaWarpSpecializedCooperativeFP8FastAccum, TmaWarpSpecializedCooperative, false>;

template <typename OutT>
cudaError_t dispatch_tile(const ScaledMmParams& p, ScaledMmTile tile, cudaStream_t stream) {
  using Fp8 = cutlass::float_e4m3_t;
  switch (tile) {
    case ScaledMmTile::kLargeCoop:
      return launch_scaled_mm_sm90<Fp8, OutT, TileLargeCoop, ScaledEpilogue>(p, stream);
    case ScaledMmTile::kTall:
      return launch_scaled_mm_sm90<Fp8, OutT, TileTall, ScaledEpilogue>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_scaled_mm_fp8_coop(const ScaledMmParams& p, ScaledMmTile tile,
                                      cudaStream_t stream) {
  if (p.out_dtype == DType::kBFloat16) return dispatch_tile<cutlass::bfloat16_t>(p, tile, stream);
  return dispatch_tile<cutlass::half_t>(p, tile, stream);
}

}  // namespace pyorch::kernels

#endif  // PYORCH_WITH_CUTLASS
