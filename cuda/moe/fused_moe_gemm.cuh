// The grouped expert GEMM of a mixture-of-experts layer (vLLM's fused_moe kernel), one launch for
// all experts: out[f] = epilogue(input[f / top_k] @ weight[e]^T) for the (token, expert) pairs f
// that moe_align_block_size sorted into BLOCK_M-row blocks of one expert e each.
//
// Work split. A CTA owns one block of sorted pairs (BLOCK_M rows) and kBlockN output columns, and
// all of K: grid (ceil(num_sorted / BLOCK_M), ceil(out_cols / kBlockN)), sized from shapes only.
// A CTA whose block lies past *num_tokens_post_padded returns at once, so the launch is
// CUDA-graph safe with no host read of the routing. Its A rows are gathered from input through
// sorted_token_ids as they are copied in (no permuted copy of the activations is ever made);
// its B rows are weight[e]'s, read once per CTA.
//
// SiLU-and-mul (SILU): weight is [gate; up] (N = 2 * out_cols rows). The CTA loads gate rows n0..
// n0 + kBlockN and the same up rows as one 2 * kBlockN-row B tile and writes silu(gate) * up, so
// the [num_flat, N] gate_up product never reaches memory. The down GEMM's epilogue multiplies by
// the pair's routing weight instead, and moe_sum adds the top_k rows of each token.
//
// Fragments: mma.sync m16n8k16 (fp32 accumulators) fed by ldmatrix from cp.async tiles whose rows
// are padded by 16 bytes (ldmatrix's 8 row addresses then hit distinct bank groups). Four warps:
// BLOCK_M = 64 gives each warp 32 rows and half the columns, BLOCK_M = 16 gives each warp all 16
// rows and a quarter of the columns. K streams through kStages shared-memory stages of kBlockK.
#pragma once

#include <cstdint>

#include "attention/paged_attention_utils.cuh"  // cp.async, ldmatrix, mma_16816
#include "common/dtype.cuh"
#include "common/reduce.cuh"

namespace pyorch::kernels {

template <typename T, int BLOCK_M, bool SILU>
struct MoeGemmTraits {
  static_assert(BLOCK_M == 16 || BLOCK_M == 64, "BLOCK_M is 16 or 64");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlockN = 64;  // output columns per CTA
  static constexpr int kBlockK = 64;
  // Decode-sized tiles (16 rows) stream weights with little math per byte: keep more k-tiles in
  // flight per CTA. 64-row tiles are math-bound: 3 stages hide the loads.
  static constexpr int kStages = BLOCK_M == 16 ? (SILU ? 4 : 6) : 3;
  static constexpr int kGroups = SILU ? 2 : 1;  // B row groups: [gate; up] or the one weight
  static constexpr int kBRows = kGroups * kBlockN;
  // 16 rows: 1 x 4 warps (each all rows, a quarter of the columns); 64 rows: 2 x 2 warps of 32
  // rows (two m16 tiles, so each B fragment feeds two mma's) and half the columns.
  static constexpr int kWarpsM = BLOCK_M == 16 ? 1 : 2;
  static constexpr int kWarpsN = kWarps / kWarpsM;
  static constexpr int kMTiles = BLOCK_M / (16 * kWarpsM);
  static constexpr int kWarpN = kBlockN / kWarpsN;  // output columns per warp
  static_assert(kWarpN % 16 == 0, "a warp's columns are whole ldmatrix_x4 pairs of n8 tiles");
  static constexpr int kNTiles = kWarpN / 8;
  static constexpr int kChunk = 16 / sizeof(T);  // elements per 16-byte copy
  static constexpr int kRowStride = kBlockK + kChunk;
  static constexpr int kAElems = BLOCK_M * kRowStride;
  static constexpr int kBElems = kBRows * kRowStride;
  static constexpr int kStageElems = kAElems + kBElems;
  static constexpr size_t kSmemBytes = sizeof(T) * kStages * kStageElems;
  static constexpr int kChunksPerRow = kBlockK / kChunk;
};

template <typename T>
struct MoeGemmParams {
  T* out;                              // [num_flat, out_cols]
  const T* input;                      // [*, K], row stride input_stride
  const T* weight;                     // [E, N, K]
  const float* topk_weights;           // [num_flat] or nullptr
  const int32_t* sorted_token_ids;     // [num_sorted]
  const int32_t* expert_ids;           // [ceil(num_sorted / BLOCK_M)]
  const int32_t* num_tokens_post_pad;  // [1]
  int64_t num_flat, num_sorted, num_experts, n, k, input_stride, top_k, out_cols;
};

// Copies k-tile kt of the CTA's gathered A rows and its B rows into one stage.
template <typename T, int BLOCK_M, bool SILU>
__device__ __forceinline__ void moe_load_tile(T* stage, const MoeGemmParams<T>& p,
                                              const int32_t (&flat)[BLOCK_M], const T* w_expert,
                                              int64_t n0, int64_t k0) {
  using Tr = MoeGemmTraits<T, BLOCK_M, SILU>;
  T* a = stage;
  T* b = stage + Tr::kAElems;
  for (int c = threadIdx.x; c < BLOCK_M * Tr::kChunksPerRow; c += Tr::kThreads) {
    const int r = c / Tr::kChunksPerRow;
    const int64_t col = k0 + (c % Tr::kChunksPerRow) * Tr::kChunk;
    const bool valid = flat[r] < p.num_flat && col < p.k;
    const T* src = valid ? p.input + (flat[r] / p.top_k) * p.input_stride + col : p.input;
    attn::cp_async_16(a + r * Tr::kRowStride + (c % Tr::kChunksPerRow) * Tr::kChunk, src, valid);
  }
  for (int c = threadIdx.x; c < Tr::kBRows * Tr::kChunksPerRow; c += Tr::kThreads) {
    const int r = c / Tr::kChunksPerRow;
    const int64_t out_col = n0 + r % Tr::kBlockN;
    const int64_t w_row = (r / Tr::kBlockN) * p.out_cols + out_col;  // group 1: the up rows
    const int64_t col = k0 + (c % Tr::kChunksPerRow) * Tr::kChunk;
    const bool valid = out_col < p.out_cols && col < p.k;
    const T* src = valid ? w_expert + w_row * p.k + col : w_expert;
    attn::cp_async_16(b + r * Tr::kRowStride + (c % Tr::kChunksPerRow) * Tr::kChunk, src, valid);
  }
}

template <typename T, int BLOCK_M, bool SILU>
__global__ void __launch_bounds__(MoeGemmTraits<T, BLOCK_M, SILU>::kThreads)
    fused_moe_gemm_kernel(const MoeGemmParams<T> p) {
  using Tr = MoeGemmTraits<T, BLOCK_M, SILU>;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * BLOCK_M;
  if (row0 >= min(static_cast<int64_t>(*p.num_tokens_post_pad), p.num_sorted)) return;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * Tr::kBlockN;
  const int32_t expert = p.expert_ids[blockIdx.x];
  __shared__ int32_t flat[BLOCK_M];  // the block's flat pair ids (>= num_flat: padding)
  for (int r = threadIdx.x; r < BLOCK_M; r += Tr::kThreads) {
    flat[r] = row0 + r < p.num_sorted ? p.sorted_token_ids[row0 + r] : p.num_flat;
    if (flat[r] < 0) flat[r] = p.num_flat;
  }
  __syncthreads();
  if (expert < 0 || expert >= p.num_experts) {  // another rank's expert: contributes zeros
    for (int c = threadIdx.x; c < BLOCK_M * Tr::kBlockN; c += Tr::kThreads) {
      const int r = c / Tr::kBlockN;
      const int64_t col = n0 + c % Tr::kBlockN;
      if (flat[r] < p.num_flat && col < p.out_cols) {
        p.out[flat[r] * p.out_cols + col] = from_float<T>(0.f);
      }
    }
    return;
  }
  extern __shared__ __align__(16) unsigned char moe_smem_raw[];
  T* smem = reinterpret_cast<T*>(moe_smem_raw);
  const T* w_expert = p.weight + expert * p.n * p.k;
  const int num_k_tiles = static_cast<int>((p.k + Tr::kBlockK - 1) / Tr::kBlockK);

#pragma unroll
  for (int s = 0; s < Tr::kStages - 1; ++s) {
    if (s < num_k_tiles) {
      moe_load_tile<T, BLOCK_M, SILU>(smem + s * Tr::kStageElems, p, flat, w_expert, n0,
                                      static_cast<int64_t>(s) * Tr::kBlockK);
    }
    attn::cp_async_commit();
  }

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int warp_m = warp % Tr::kWarpsM;
  const int warp_n = warp / Tr::kWarpsM;
  float acc[Tr::kMTiles][Tr::kGroups][Tr::kNTiles][4] = {};
  // ldmatrix row addresses: A as in a Q tile, B (weight rows = n) as in a K tile of attention.
  const int a_off = (warp_m * 16 * Tr::kMTiles + lane % 16) * Tr::kRowStride + (lane / 16) * 8;
  const int b_off =
      (warp_n * Tr::kWarpN + lane % 8 + (lane / 16) * 8) * Tr::kRowStride + ((lane / 8) % 2) * 8;

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    attn::cp_async_wait<Tr::kStages - 2>();
    __syncthreads();  // tile kt landed for every thread; tile kt - 1's stage is free again
    const int next = kt + Tr::kStages - 1;
    if (next < num_k_tiles) {
      moe_load_tile<T, BLOCK_M, SILU>(smem + (next % Tr::kStages) * Tr::kStageElems, p, flat,
                                      w_expert, n0, static_cast<int64_t>(next) * Tr::kBlockK);
    }
    attn::cp_async_commit();
    const T* a = smem + (kt % Tr::kStages) * Tr::kStageElems;
    const T* b = a + Tr::kAElems;
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockK / 16; ++kk) {
      uint32_t af[Tr::kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        attn::ldmatrix_x4(af[mt], a + a_off + mt * 16 * Tr::kRowStride + kk * 16);
      }
#pragma unroll
      for (int g = 0; g < Tr::kGroups; ++g) {
#pragma unroll
        for (int nn = 0; nn < Tr::kNTiles / 2; ++nn) {
          uint32_t bf[4];
          attn::ldmatrix_x4(bf, b + b_off + (g * Tr::kBlockN + nn * 16) * Tr::kRowStride + kk * 16);
#pragma unroll
          for (int mt = 0; mt < Tr::kMTiles; ++mt) {
            attn::mma_16816<T>(acc[mt][g][2 * nn], af[mt], bf[0], bf[1]);
            attn::mma_16816<T>(acc[mt][g][2 * nn + 1], af[mt], bf[2], bf[3]);
          }
        }
      }
    }
  }
  attn::cp_async_wait<0>();  // no copy may land after the CTA exits

  // Epilogue. acc[mt][g][t] holds rows lane / 4 (+ 8) of m16 tile mt and columns
  // 2 * (lane % 4) (+ 1) of n8 tile t.
#pragma unroll
  for (int rt = 0; rt < 2 * Tr::kMTiles; ++rt) {
    const int mt = rt / 2, half = rt % 2;
    const int r = (warp_m * Tr::kMTiles + mt) * 16 + lane / 4 + half * 8;
    const int64_t f = flat[r];
    if (f >= p.num_flat) continue;
    const float scale = p.topk_weights ? p.topk_weights[f] : 1.f;
#pragma unroll
    for (int t = 0; t < Tr::kNTiles; ++t) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int64_t col = n0 + warp_n * Tr::kWarpN + t * 8 + 2 * (lane % 4) + i;
        if (col >= p.out_cols) continue;
        float v = acc[mt][0][t][half * 2 + i];
        if constexpr (SILU) {
          const float up = acc[mt][Tr::kGroups - 1][t][half * 2 + i];
          v = v / (1.f + __expf(-v)) * up;
        }
        p.out[f * p.out_cols + col] = from_float<T>(v * scale);
      }
    }
  }
}

template <typename T, int BLOCK_M, bool SILU>
cudaError_t launch_fused_moe_gemm(const MoeGemmParams<T>& p, cudaStream_t stream) {
  using Tr = MoeGemmTraits<T, BLOCK_M, SILU>;
  const int64_t grid_m = (p.num_sorted + BLOCK_M - 1) / BLOCK_M;
  const int64_t grid_n = (p.out_cols + Tr::kBlockN - 1) / Tr::kBlockN;
  if (grid_m == 0 || grid_n == 0) return cudaSuccess;
  if (grid_m > 0x7fffffff || grid_n > 65535) return cudaErrorInvalidValue;
  auto kernel = fused_moe_gemm_kernel<T, BLOCK_M, SILU>;
  PYORCH_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(Tr::kSmemBytes)));
  kernel<<<dim3(static_cast<unsigned>(grid_m), static_cast<unsigned>(grid_n)), Tr::kThreads,
           Tr::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace pyorch::kernels
