// int8 x int8 (int32 accumulate) -> bf16 / fp16: the scaled GEMM in the five tile configurations
// of ScaledMmTile (10 kernels) and the zero-point (azp) variant in two unswapped ones (4).
#ifdef PYORCH_WITH_CUTLASS

#include "quantization/scaled_mm_sm90.cuh"

namespace pyorch::kernels {

namespace {

using cutlass::epilogue::TmaWarpSpecialized;
using cutlass::epilogue::TmaWarpSpecializedCooperative;
using cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using cutlass::gemm::KernelTmaWarpSpecializedPingpong;

// vLLM's sm90 int8 choices: ping-pong for the small and medium tiles, the cooperative schedule
// (both consumer warp groups on one 128-row tile) for large m; the decode tiles swap A and B as
// the fp8 ones do. int8 wgmma takes k in steps of 32 like fp8, so the tile k extents match.
using TileSwapM16 = Sm90Tile<Shape<_64, _16, _256>, Shape<_1, _1, _1>,
                             KernelTmaWarpSpecializedPingpong, TmaWarpSpecialized, true>;
using TileSwapM64 = Sm90Tile<Shape<_64, _64, _256>, Shape<_1, _1, _1>,
                             KernelTmaWarpSpecializedPingpong, TmaWarpSpecialized, true>;
using TileM256 = Sm90Tile<Shape<_64, _128, _128>, Shape<_2, _1, _1>,
                          KernelTmaWarpSpecializedPingpong, TmaWarpSpecialized, false>;
using TileLarge =
    Sm90Tile<Shape<_128, _128, _128>, Shape<_2, _1, _1>, KernelTmaWarpSpecializedCooperative,
             TmaWarpSpecializedCooperative, false>;

using TileHuge =
    Sm90Tile<Shape<_128, _256, _128>, Shape<_2, _1, _1>, KernelTmaWarpSpecializedCooperative,
             TmaWarpSpecializedCooperative, false>;

template <typename OutT>
cudaError_t dispatch_tile(const ScaledMmParams& p, ScaledMmTile tile, cudaStream_t stream) {
  switch (tile) {
    case ScaledMmTile::kSwapM16:
      return launch_scaled_mm_sm90<int8_t, OutT, TileSwapM16, ScaledEpilogue>(p, stream);
    case ScaledMmTile::kSwapM64:
      return launch_scaled_mm_sm90<int8_t, OutT, TileSwapM64, ScaledEpilogue>(p, stream);
    case ScaledMmTile::kM256:
      return launch_scaled_mm_sm90<int8_t, OutT, TileM256, ScaledEpilogue>(p, stream);
    case ScaledMmTile::kLarge:
      return launch_scaled_mm_sm90<int8_t, OutT, TileLarge, ScaledEpilogue>(p, stream);
    case ScaledMmTile::kHuge:
      return launch_scaled_mm_sm90<int8_t, OutT, TileHuge, ScaledEpilogue>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

// The zero-point epilogue reads azp per row of D, so it is built unswapped only: decode sizes run
// on the 64 x 128 tile.
template <typename OutT>
cudaError_t dispatch_azp_tile(const ScaledMmParams& p, ScaledMmTile tile, cudaStream_t stream) {
  switch (tile) {
    case ScaledMmTile::kM256:
      return launch_scaled_mm_sm90<int8_t, OutT, TileM256, AzpEpilogue>(p, stream);
    case ScaledMmTile::kLarge:
      return launch_scaled_mm_sm90<int8_t, OutT, TileLarge, AzpEpilogue>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_scaled_mm_int8(const ScaledMmParams& p, ScaledMmTile tile, cudaStream_t stream) {
  if (p.out_dtype == DType::kBFloat16) return dispatch_tile<cutlass::bfloat16_t>(p, tile, stream);
  return dispatch_tile<cutlass::half_t>(p, tile, stream);
}

cudaError_t launch_scaled_mm_azp(const ScaledMmParams& p, ScaledMmTile tile, cudaStream_t stream) {
  if (p.out_dtype == DType::kBFloat16) {
    return dispatch_azp_tile<cutlass::bfloat16_t>(p, tile, stream);
  }
  return dispatch_azp_tile<cutlass::half_t>(p, tile, stream);
}

}  // namespace pyorch::kernels

#endif  // PYORCH_WITH_CUTLASS
