// The prefill path of the mixture-of-experts layer: the routed (token, expert) pairs gathered into
// an expert-sorted buffer (moe_grouped_permute), one grouped GEMM per projection with one problem
// per expert (moe_grouped_gemm: CUTLASS 3.x ptr-array, wgmma + TMA, warp-specialized, persistent;
// sm90a only) and the weighted sum back into token order (moe_grouped_unpermute). No host read of
// the routing anywhere: CUDA-graph safe; buffers are sized for the worst case by the caller.
// M tokens, top_k experts per token, num_flat = M * top_k pairs, f = token * top_k + j.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// Whether the grouped GEMM was compiled in (it needs the CUTLASS headers at build time).
bool moe_grouped_gemm_available();

// Sorts the pairs by local expert and gathers their token rows:
//   expert_offsets [num_local_experts + 1] int32: expert e's rows are [offsets[e], offsets[e+1]);
//   inv_perm [num_flat] int32: the row of pair f in permuted, or -1 when its expert is not local
//     (expert_map[id] == -1, or id outside [0, num_global_experts));
//   permuted [num_flat, H] (contiguous): row inv_perm[f] = input[f / top_k]; rows past
//     offsets[num_local_experts] are left as they were.
// input [M, H] (row stride input_stride) fp32/fp16/bf16/fp8; topk_ids [num_flat] int32/int64;
// expert_map [num_global_experts] int32 or nullptr (then local = global). The order of one
// expert's rows is unspecified (atomics). One CTA sorts, then one CTA per pair copies.
cudaError_t moe_grouped_permute(void* permuted, int32_t* expert_offsets, int32_t* inv_perm,
                                const void* input, DType dtype, int64_t input_stride,
                                const void* topk_ids, DType ids_dtype, const int32_t* expert_map,
                                int64_t num_tokens, int64_t top_k, int64_t num_global_experts,
                                int64_t num_local_experts, int64_t hidden_size,
                                cudaStream_t stream);

// Device bytes moe_grouped_gemm needs as workspace for num_experts problems on the current device.
size_t moe_grouped_gemm_workspace_size(int64_t num_experts, DType dtype);

// out[r] = alpha[e] * (a[r] @ weight[e]^T) for r in [offsets[e], offsets[e + 1]), e < num_experts
// (alpha null: 1). a: [num_rows, K] contiguous; weight: [E, N, K] contiguous; out: [num_rows, N]
// contiguous bf16. dtype: bf16 (a, weight bf16) or fp8 e4m3 (a, weight fp8; alpha [E] fp32
// required). N, K multiples of 16 bytes' worth of elements; base pointers 16-byte aligned. Rows
// past offsets[E] are not written.
cudaError_t moe_grouped_gemm(void* out, const void* a, const void* weight,
                             const int32_t* expert_offsets, const float* alpha, DType dtype,
                             int64_t num_rows, int64_t num_experts, int64_t n, int64_t k,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream);

// output[t] = sum_j topk_weights[t, j] * permuted[inv_perm[t * top_k + j]] (pairs with inv_perm
// -1 add nothing; topk_weights null: weight 1), fp32 sum rounded once. permuted [*, H], output
// [M, H] contiguous, same dtype (fp32/fp16/bf16); topk_weights [M, top_k] fp32 contiguous.
cudaError_t moe_grouped_unpermute(void* output, const void* permuted, const int32_t* inv_perm,
                                  const float* topk_weights, DType dtype, int64_t num_tokens,
                                  int64_t top_k, int64_t hidden_size, cudaStream_t stream);

}  // namespace pyorch
