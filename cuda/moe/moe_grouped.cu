// The MoE prefill path's permute / un-permute kernels and the grouped GEMM dispatcher
// (pyorch/moe_grouped.h). The CUTLASS kernels themselves live in moe_grouped_gemm_*.cu.
#include <cstdio>

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "moe/moe_grouped_internal.h"
#include "pyorch/moe.h"
#include "pyorch/moe_grouped.h"

namespace pyorch {

namespace kernels {

constexpr int kSortThreads = 1024;

template <typename IdT>
__device__ __forceinline__ int local_expert_of(const IdT* ids, const int32_t* expert_map, int64_t f,
                                               int num_global, int num_local) {
  const int64_t id = static_cast<int64_t>(ids[f]);
  if (id < 0 || id >= num_global) return -1;
  const int e = expert_map != nullptr ? expert_map[id] : static_cast<int>(id);
  return e >= 0 && e < num_local ? e : -1;
}

// One CTA: count the pairs of each local expert, scan to offsets, then hand out rows.
template <typename IdT>
__global__ void __launch_bounds__(kSortThreads)
    moe_grouped_sort_kernel(int32_t* offsets, int32_t* inv_perm, const IdT* ids,
                            const int32_t* expert_map, int64_t num_flat, int num_global,
                            int num_local) {
  extern __shared__ int32_t sort_smem[];
  int32_t* counts = sort_smem;              // [num_local], then the inclusive scan
  int32_t* cursor = sort_smem + num_local;  // [num_local]
  int32_t* scratch = cursor + num_local;    // [num_local]
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int64_t f = threadIdx.x; f < num_flat; f += blockDim.x) {
    const int e = local_expert_of(ids, expert_map, f, num_global, num_local);
    if (e >= 0) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  // Hillis-Steele inclusive scan over num_local (<= kMoeMaxExperts) counters, ping-ponging.
  int32_t* src = counts;
  int32_t* dst = scratch;
  for (int step = 1; step < num_local; step *= 2) {
    for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
      dst[e] = src[e] + (e >= step ? src[e - step] : 0);
    }
    __syncthreads();
    int32_t* t = src;
    src = dst;
    dst = t;
  }
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    const int32_t start = e == 0 ? 0 : src[e - 1];
    cursor[e] = start;
    offsets[e] = start;
  }
  if (threadIdx.x == 0) offsets[num_local] = src[num_local - 1];
  __syncthreads();
  for (int64_t f = threadIdx.x; f < num_flat; f += blockDim.x) {
    const int e = local_expert_of(ids, expert_map, f, num_global, num_local);
    inv_perm[f] = e >= 0 ? atomicAdd(&cursor[e], 1) : -1;
  }
}

// One CTA per pair: permuted[inv_perm[f]] = input[f / top_k], VEC elements per access.
template <typename T, int VEC>
__global__ void moe_grouped_gather_kernel(T* permuted, const T* input, const int32_t* inv_perm,
                                          int64_t input_stride, int64_t top_k, int64_t hidden) {
  const int64_t f = blockIdx.x;
  const int32_t row = inv_perm[f];
  if (row < 0) return;
  const T* src = input + (f / top_k) * input_stride;
  T* dst = permuted + static_cast<int64_t>(row) * hidden;
  if constexpr (VEC > 1) {
    using V = uint4;
    static_assert(sizeof(T) * VEC == sizeof(V), "VEC elements make one 16-byte vector");
    for (int64_t c = threadIdx.x; c < hidden / VEC; c += blockDim.x) {
      reinterpret_cast<V*>(dst)[c] = reinterpret_cast<const V*>(src)[c];
    }
  } else {
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = src[c];
  }
}

// One CTA per token: output[t] = sum_j w[t, j] * permuted[inv_perm[t * top_k + j]].
template <typename T, int VEC>
__global__ void moe_grouped_unpermute_kernel(T* output, const T* permuted, const int32_t* inv_perm,
                                             const float* topk_weights, int top_k, int64_t hidden) {
  const int64_t t = blockIdx.x;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < hidden;
       c += static_cast<int64_t>(blockDim.x) * VEC) {
    float acc[VEC] = {};
    for (int j = 0; j < top_k; ++j) {
      const int32_t row = inv_perm[t * top_k + j];
      if (row < 0) continue;
      const float w = topk_weights != nullptr ? topk_weights[t * top_k + j] : 1.f;
      const T* src = permuted + static_cast<int64_t>(row) * hidden + c;
      if constexpr (VEC > 1) {
        uint4 raw = *reinterpret_cast<const uint4*>(src);
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += w * to_float(v[i]);
      } else {
        acc[0] += w * to_float(src[0]);
      }
    }
    T* dst = output + t * hidden + c;
    if constexpr (VEC > 1) {
      uint4 raw;
      T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = from_float<T>(acc[i]);
      *reinterpret_cast<uint4*>(dst) = raw;
    } else {
      dst[0] = from_float<T>(acc[0]);
    }
  }
}

}  // namespace kernels

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
cudaError_t launch_gather(void* permuted, const void* input, const int32_t* inv_perm,
                          int64_t input_stride, int64_t num_flat, int64_t top_k, int64_t hidden,
                          cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec =
      hidden % kVec == 0 && input_stride % kVec == 0 && aligned16(input) && aligned16(permuted);
  const int threads = 128;
  const auto grid = static_cast<unsigned>(num_flat);
  if (vec) {
    kernels::moe_grouped_gather_kernel<T, kVec>
        <<<grid, threads, 0, stream>>>(static_cast<T*>(permuted), static_cast<const T*>(input),
                                       inv_perm, input_stride, top_k, hidden);
  } else {
    kernels::moe_grouped_gather_kernel<T, 1>
        <<<grid, threads, 0, stream>>>(static_cast<T*>(permuted), static_cast<const T*>(input),
                                       inv_perm, input_stride, top_k, hidden);
  }
  return cudaGetLastError();
}

// The tile for num_rows rows over num_experts experts (the average per expert is all the host
// knows): swapped tiles while experts hold few rows, the 128 x 256 tile for prefill.
kernels::MoeGroupedTile pick_tile(int64_t num_rows, int64_t num_experts) {
  const int64_t per_expert = num_rows / (num_experts > 0 ? num_experts : 1);
  if (per_expert <= 24) return kernels::MoeGroupedTile::kSwap32;
  if (per_expert <= 96) return kernels::MoeGroupedTile::kSwap64;
  return kernels::MoeGroupedTile::kLarge;
}

// The current device and its SM count (0 when either cannot be asked: CUTLASS then asks).
int device_and_sm_count(int* device) {
  *device = 0;
  if (cudaGetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return current_device_sm_count();
}

}  // namespace

bool moe_grouped_gemm_available() {
#ifdef PYORCH_WITH_CUTLASS
  return true;
#else
  return false;
#endif
}

cudaError_t moe_grouped_permute(void* permuted, int32_t* expert_offsets, int32_t* inv_perm,
                                const void* input, DType dtype, int64_t input_stride,
                                const void* topk_ids, DType ids_dtype, const int32_t* expert_map,
                                int64_t num_tokens, int64_t top_k, int64_t num_global_experts,
                                int64_t num_local_experts, int64_t hidden_size,
                                cudaStream_t stream) {
  if (num_local_experts < 1 || num_local_experts > kMoeMaxExperts || num_global_experts < 1 ||
      top_k < 1) {
    PYORCH_INVALID("moe_grouped_permute: need 1 <= num_local_experts <= %d and top_k >= 1",
                   static_cast<int>(kMoeMaxExperts));
  }
  const int64_t num_flat = num_tokens * top_k;
  const size_t smem = sizeof(int32_t) * 3 * num_local_experts;
  const int ng = static_cast<int>(num_global_experts), nl = static_cast<int>(num_local_experts);
  if (ids_dtype == DType::kInt32) {
    kernels::moe_grouped_sort_kernel<int32_t><<<1, kernels::kSortThreads, smem, stream>>>(
        expert_offsets, inv_perm, static_cast<const int32_t*>(topk_ids), expert_map, num_flat, ng,
        nl);
  } else if (ids_dtype == DType::kInt64) {
    kernels::moe_grouped_sort_kernel<int64_t><<<1, kernels::kSortThreads, smem, stream>>>(
        expert_offsets, inv_perm, static_cast<const int64_t*>(topk_ids), expert_map, num_flat, ng,
        nl);
  } else {
    PYORCH_INVALID("moe_grouped_permute: topk_ids must be int32 or int64");
  }
  PYORCH_RETURN_IF_ERROR(cudaGetLastError());
  if (num_flat == 0 || hidden_size == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return launch_gather<float>(permuted, input, inv_perm, input_stride, num_flat, top_k,
                                  hidden_size, stream);
    case DType::kFloat16:
    case DType::kBFloat16:
      return launch_gather<__half>(permuted, input, inv_perm, input_stride, num_flat, top_k,
                                   hidden_size, stream);
    case DType::kFp8E4M3:
      return launch_gather<uint8_t>(permuted, input, inv_perm, input_stride, num_flat, top_k,
                                    hidden_size, stream);
    default: PYORCH_INVALID("moe_grouped_permute: unsupported dtype %s", dtype_name(dtype));
  }
}

size_t moe_grouped_gemm_workspace_size(int64_t num_experts, DType dtype) {
#ifdef PYORCH_WITH_CUTLASS
  int device = 0;
  const int sms = device_and_sm_count(&device);
  size_t most = 0;
  for (auto tile : {kernels::MoeGroupedTile::kSwap32, kernels::MoeGroupedTile::kSwap64,
                    kernels::MoeGroupedTile::kLarge}) {
    const size_t b = dtype == DType::kFp8E4M3
                         ? kernels::grouped_gemm_workspace_fp8(tile, num_experts, sms, device)
                         : kernels::grouped_gemm_workspace_bf16(tile, num_experts, sms, device);
    most = b > most ? b : most;
  }
  return most;
#else
  (void)num_experts;
  (void)dtype;
  return 0;
#endif
}

cudaError_t moe_grouped_gemm(void* out, const void* a, const void* weight,
                             const int32_t* expert_offsets, const float* alpha, DType dtype,
                             int64_t num_rows, int64_t num_experts, int64_t n, int64_t k,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
#ifdef PYORCH_WITH_CUTLASS
  if (num_experts < 1 || n % 16 != 0 || k % 16 != 0) {
    PYORCH_INVALID("moe_grouped_gemm: need num_experts >= 1 and N, K multiples of 16");
  }
  if (num_rows == 0) return cudaSuccess;
  kernels::MoeGroupedGemmParams p{out, a, weight,    expert_offsets,  alpha, num_experts,
                                  n,   k, workspace, workspace_bytes, 0,     0};
  p.sm_count = device_and_sm_count(&p.device);
  const kernels::MoeGroupedTile tile = pick_tile(num_rows, num_experts);
  if (dtype == DType::kBFloat16) {
    if (alpha != nullptr) PYORCH_INVALID("moe_grouped_gemm: alpha is for fp8 operands only");
    return kernels::launch_grouped_gemm_bf16(p, tile, stream);
  }
  if (dtype == DType::kFp8E4M3) {
    if (alpha == nullptr) PYORCH_INVALID("moe_grouped_gemm: fp8 operands need alpha");
    return kernels::launch_grouped_gemm_fp8(p, tile, stream);
  }
  PYORCH_INVALID("moe_grouped_gemm: unsupported dtype %s (bfloat16 or fp8_e4m3)",
                 dtype_name(dtype));
#else
  (void)out, (void)a, (void)weight, (void)expert_offsets, (void)alpha, (void)dtype;
  (void)num_rows, (void)num_experts, (void)n, (void)k, (void)workspace, (void)workspace_bytes;
  (void)stream;
  std::fprintf(stderr, "pyorch: moe_grouped_gemm: built without CUTLASS\n");
  return cudaErrorNotSupported;
#endif
}

cudaError_t moe_grouped_unpermute(void* output, const void* permuted, const int32_t* inv_perm,
                                  const float* topk_weights, DType dtype, int64_t num_tokens,
                                  int64_t top_k, int64_t hidden_size, cudaStream_t stream) {
  if (num_tokens == 0 || hidden_size == 0) return cudaSuccess;
  const auto grid = static_cast<unsigned>(num_tokens);
  const int k = static_cast<int>(top_k);
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = hidden_size % kVec == 0 && aligned16(output) && aligned16(permuted);
    const int threads = 256;
    if (vec) {
      kernels::moe_grouped_unpermute_kernel<T, kVec>
          <<<grid, threads, 0, stream>>>(static_cast<T*>(output), static_cast<const T*>(permuted),
                                         inv_perm, topk_weights, k, hidden_size);
    } else {
      kernels::moe_grouped_unpermute_kernel<T, 1>
          <<<grid, threads, 0, stream>>>(static_cast<T*>(output), static_cast<const T*>(permuted),
                                         inv_perm, topk_weights, k, hidden_size);
    }
    return cudaGetLastError();
  });
}

}  // namespace pyorch
