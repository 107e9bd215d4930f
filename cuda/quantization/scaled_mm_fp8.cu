// fp8 e4m3 x fp8 e4m3 -> bf16 / fp16 with per-tensor/token/channel scales: four of the tile
// configurations of ScaledMmTile, each for both output types (8 kernels); the dispatch of all.
#ifdef PYORCH_WITH_CUTLASS

#include "quantization/scaled_mm_sm90.cuh"

namespace pyorch::kernels {

namespace {

using cutlass::epilogue::TmaWarpSpecialized;
using cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;

// vLLM's sm90 fp8 choices: the ping-pong schedule (two consumer warp groups alternate tiles, one
// in its epilogue while the other runs wgmma) with fp8 fast accumulation everywhere; the decode
// tiles put the weight on the 64-row side (SWAP_AB) so 1..64 tokens do not pad a 64- or
// 128-row tile.
using TileSwapM16 =
    Sm90Tile<Shape<_64, _16, _256>, Shape<_1, _1, _1>, KernelTmaWarpSpecializedPingpongFP8FastAccum,
             TmaWarpSpecialized, true>;
using TileSwapM64 =
    Sm90Tile<Shape<_64, _64, _256>, Shape<_1, _1, _1>, KernelTmaWarpSpecializedPingpongFP8FastAccum,
             TmaWarpSpecialized, true>;
using TileM256 = Sm90Tile<Shape<_64, _128, _128>, Shape<_2, _1, _1>,
                          KernelTmaWarpSpecializedPingpongFP8FastAccum, TmaWarpSpecialized, false>;
using TileLarge = Sm90Tile<Shape<_128, _128, _128>, Shape<_2, _1, _1>,
                           KernelTmaWarpSpecializedPingpongFP8FastAccum, TmaWarpSpecialized, false>;

template <typename OutT>
cudaError_t dispatch_tile(const ScaledMmParams& p, ScaledMmTile tile, cudaStream_t stream) {
  using Fp8 = cutlass::float_e4m3_t;
  switch (tile) {
    case ScaledMmTile::kSwapM16:
      return launch_scaled_mm_sm90<Fp8, OutT, TileSwapM16, ScaledEpilogue>(p, stream);
    case ScaledMmTile::kSwapM64:
      return launch_scaled_mm_sm90<Fp8, OutT, TileSwapM64, ScaledEpilogue>(p, stream);
    case ScaledMmTile::kM256:
      return launch_scaled_mm_sm90<Fp8, OutT, TileM256, ScaledEpilogue>(p, stream);
    case ScaledMmTile::kLarge:
      return launch_scaled_mm_sm90<Fp8, OutT, TileLarge, ScaledEpilogue>(p, stream);
    case ScaledMmTile::kHuge: return launch_scaled_mm_fp8_huge(p, stream);
    case ScaledMmTile::kLargeCoop:
    case ScaledMmTile::kTall: return launch_scaled_mm_fp8_coop(p, tile, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_scaled_mm_fp8(const ScaledMmParams& p, ScaledMmTile tile, cudaStream_t stream) {
  if (p.out_dtype == DType::kBFloat16) return dispatch_tile<cutlass::bfloat16_t>(p, tile, stream);
  return dispatch_tile<cutlass::half_t>(p, tile, stream);
}

}  // namespace pyorch::kernels

#endif  // PYORCH_WITH_CUTLASS
