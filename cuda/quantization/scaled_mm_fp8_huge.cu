// fp8 e4m3 x fp8 e4m3 -> bf16 / fp16 on the 128 x 256 x 128 tile (ScaledMmTile::kHuge): the
// cooperative schedule (both consumer warp groups on one 128-row tile) with fp8 fast
// accumulation, clusters of 2 along m. The default of the largest problems (m n k >= 2^40, where
// the GPU is power-bound: default_scaled_mm_tile): the wider tile halves the A reloads per
// wgmma. Its own file, so the other fp8 tiles need not recompile.
#ifdef PYORCH_WITH_CUTLASS

#include "quantization/scaled_mm_sm90.cuh"

namespace pyorch::kernels {

namespace {

using TileHuge = Sm90Tile<Shape<_128, _256, _128>, Shape<_2, _1, _1>,
                          cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                          cutlass::epilogue::TmaWarpSpecializedCooperative, false>;

}  // namespace

cudaError_t launch_scaled_mm_fp8_huge(const ScaledMmParams& p, cudaStream_t stream) {
  using Fp8 = cutlass::float_e4m3_t;
  if (p.out_dtype == DType::kBFloat16) {
    return launch_scaled_mm_sm90<Fp8, cutlass::bfloat16_t, TileHuge, ScaledEpilogue>(p, stream);
  }
  return launch_scaled_mm_sm90<Fp8, cutlass::half_t, TileHuge, ScaledEpilogue>(p, stream);
}

}  // namespace pyorch::kernels

#endif  // PYORCH_WITH_CUTLASS
