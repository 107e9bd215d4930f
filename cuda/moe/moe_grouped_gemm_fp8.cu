// fp8 e4m3 instantiations of the MoE grouped GEMM (moe_grouped_gemm_sm90.cuh): three tiles,
// fp8 fast accumulation, bf16 out, a per-expert alpha (activation scale x expert weight scale).
#ifdef PYORCH_WITH_CUTLASS

#include "moe/moe_grouped_gemm_sm90.cuh"

namespace pyorch::kernels {

namespace {

using cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum;

using TileSwap32 = Sm90GroupedTile<Shape<_128, _32, _128>, Shape<_1, _1, _1>,
                                   KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                                   PtrArrayTmaWarpSpecializedCooperative, true>;
using TileSwap64 = Sm90GroupedTile<Shape<_128, _64, _128>, Shape<_1, _1, _1>,
                                   KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                                   PtrArrayTmaWarpSpecializedCooperative, true>;
using TileLarge = Sm90GroupedTile<Shape<_128, _256, _128>, Shape<_1, _2, _1>,
                                  KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                                  PtrArrayTmaWarpSpecializedCooperative, false>;
using Bf16 = cutlass::bfloat16_t;
using Fp8 = cutlass::float_e4m3_t;

}  // namespace

size_t grouped_gemm_workspace_fp8(MoeGroupedTile tile, int64_t num_experts, int sm_count,
                                  int device) {
  switch (tile) {
    case MoeGroupedTile::kSwap32:
      return grouped_gemm_workspace<Fp8, Bf16, TileSwap32>(num_experts, sm_count, device);
    case MoeGroupedTile::kSwap64:
      return grouped_gemm_workspace<Fp8, Bf16, TileSwap64>(num_experts, sm_count, device);
    case MoeGroupedTile::kLarge:
      return grouped_gemm_workspace<Fp8, Bf16, TileLarge>(num_experts, sm_count, device);
  }
  return 0;
}

cudaError_t launch_grouped_gemm_fp8(const MoeGroupedGemmParams& p, MoeGroupedTile tile,
                                    cudaStream_t stream) {
  switch (tile) {
    case MoeGroupedTile::kSwap32: return launch_grouped_gemm<Fp8, Bf16, TileSwap32>(p, stream);
    case MoeGroupedTile::kSwap64: return launch_grouped_gemm<Fp8, Bf16, TileSwap64>(p, stream);
    case MoeGroupedTile::kLarge: return launch_grouped_gemm<Fp8, Bf16, TileLarge>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pyorch::kernels

#endif  // PYORCH_WITH_CUTLASS
