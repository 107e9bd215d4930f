// Internal interface between cuda/moe/moe_grouped.cu (the dispatcher) and the .cu files that
// instantiate the CUTLASS grouped GEMM (moe_grouped_gemm_*.cu, only compiled with CUTLASS).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch::kernels {

// The tile configurations, picked from the average rows per expert (a host-known number).
enum class MoeGroupedTile : int32_t {
  kSwap32 = 0,  // swapped, 128 weight rows x 32 expert rows: up to ~32 rows per expert
  kSwap64 = 1,  // swapped, 128 x 64: up to ~96 rows per expert
  kLarge = 2,   // plain, 128 rows x 256 columns, 2-CTA clusters along N: prefill
};

struct MoeGroupedGemmParams {
  void* out;                      // [rows, n] row-major
  const void* a;                  // [rows, k] row-major, expert-sorted
  const void* weight;             // [E, n, k]
  const int32_t* expert_offsets;  // [E + 1]
  const float* alpha;             // [E] per-expert output scale, or nullptr (1)
  int64_t num_experts, n, k;
  void* workspace;
  size_t workspace_bytes;
  int sm_count, device;
};

// bf16 x bf16 -> bf16 (moe_grouped_gemm_bf16.cu).
size_t grouped_gemm_workspace_bf16(MoeGroupedTile tile, int64_t num_experts, int sm_count,
                                   int device);
cudaError_t launch_grouped_gemm_bf16(const MoeGroupedGemmParams& p, MoeGroupedTile tile,
                                     cudaStream_t stream);
// fp8 e4m3 x fp8 e4m3 -> bf16 with per-expert alpha (moe_grouped_gemm_fp8.cu).
size_t grouped_gemm_workspace_fp8(MoeGroupedTile tile, int64_t num_experts, int sm_count,
                                  int device);
cudaError_t launch_grouped_gemm_fp8(const MoeGroupedGemmParams& p, MoeGroupedTile tile,
                                    cudaStream_t stream);

}  // namespace pyorch::kernels
