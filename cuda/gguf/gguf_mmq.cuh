// gguf_mul_mat: many tokens. A thread block owns 64 (small grids: 32) weight rows x 32 tokens.
// For each 256-wide slice of K it decodes the rows' blocks into int8 in shared memory (with a
// (scale, bias) pair per scale group), copies the tokens' q8_1 values beside them, and each warp
// takes int8 tensor-core products (mma m16n8k16, s8 x s8 -> s32) of 16 rows x 32 tokens, one scale
// group (16 or 32 values) at a time, folding each group's int32 sums into fp32 with its scales.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "gguf/gguf_blocks.cuh"
#include "gguf/gguf_mmvq.cuh"
#include "gguf/gguf_q8_1.cuh"

namespace pyorch::kernels::gguf {

constexpr int kMmqTokens = 32;  // tokens per thread block
constexpr int kMmqK = 256;      // K slice decoded per step: one K-quant block, eight 32-blocks
constexpr int kMmqPad = 16;     // row padding (bytes): rows 68 words apart, conflict-free reads
constexpr int kMmqGroups = kMmqK / kHalfSize;  // scale groups per slice, at most
constexpr int kMmqSubs = kMmqK / kSubSize;
static_assert(kMmqTokens % 8 == 0, "n8 tiles of tokens");

// A thread block of WARPS warps owns 16 * WARPS weight rows (one m16 tile per warp) x kMmqTokens.
template <int WARPS>
struct MmqSmem {
  static constexpr int kRows = 16 * WARPS;
  alignas(16) int8_t w[kRows][kMmqK + kMmqPad];       // decoded weights q_w
  float2 w_sb[kRows][kMmqGroups];                     // (scale_w, bias_w) per group
  alignas(16) int8_t x[kMmqTokens][kMmqK + kMmqPad];  // q8_1 values q_x
  float2 x_ds[kMmqTokens][kMmqGroups];                // (d_x, d_x * sum q_x) per group
};

// c += a (16x16, row) * b (16x8, col), int8 in, int32 out (PTX fragment layout of m16n8k16).
__device__ __forceinline__ void mma_s8_16816(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// Decodes the weight rows' and copies the tokens' sub-blocks k0 .. k0 + 256 into smem (zeros
// past the matrix edges, which then add nothing). Every thread first issues all of its loads
// (out-of-range jobs read a clamped, valid address and are zeroed after), then stores: one memory
// round trip per slice rather than one per job.
template <int TYPE, int WARPS>
__device__ __forceinline__ void mmq_fill(MmqSmem<WARPS>& sm, const uint8_t* __restrict__ weight,
                                         const int8_t* __restrict__ xq,
                                         const Q81Scale* __restrict__ xds, int64_t row0,
                                         int64_t tok0, int64_t k0, int64_t num_tokens,
                                         int64_t output_size, int64_t input_size,
                                         int64_t weight_row_stride_bytes) {
  using Traits = BlockTraits<TYPE>;
  constexpr int kThreads = WARPS * kWarpSize;
  constexpr int kMmqRows = MmqSmem<WARPS>::kRows;
  constexpr int kSubsPerBlock = Traits::kBlockSize / kSubSize;
  constexpr int kWJobs = kMmqRows * kMmqSubs / kThreads;
  constexpr int kXJobs = kMmqTokens * kMmqSubs / kThreads;
  static_assert(kWJobs * kThreads == kMmqRows * kMmqSubs, "whole jobs per thread");
  static_assert(kXJobs * kThreads == kMmqTokens * kMmqSubs, "whole jobs per thread");
  const int64_t num_subs = input_size / kSubSize;

  Sub32 w[kWJobs];
  bool w_valid[kWJobs];
#pragma unroll
  for (int i = 0; i < kWJobs; ++i) {
    const int job = threadIdx.x + i * kThreads;
    const int64_t row = row0 + job / kMmqSubs, sub_idx = k0 / kSubSize + job % kMmqSubs;
    w_valid[i] = row < output_size && sub_idx < num_subs;
    const int64_t r = row < output_size ? row : output_size - 1;
    const int64_t u = sub_idx < num_subs ? sub_idx : num_subs - 1;
    Traits::unpack(weight + r * weight_row_stride_bytes + (u / kSubsPerBlock) * Traits::kBlockBytes,
                   static_cast<int>(u % kSubsPerBlock), w[i]);
  }
  int4 xv[kXJobs][2];
  Q81Scale ds[kXJobs];
  bool x_valid[kXJobs];
#pragma unroll
  for (int i = 0; i < kXJobs; ++i) {
    const int job = threadIdx.x + i * kThreads;
    const int64_t tok = tok0 + job / kMmqSubs, sub_idx = k0 / kSubSize + job % kMmqSubs;
    x_valid[i] = tok < num_tokens && sub_idx < num_subs;
    const int64_t t = tok < num_tokens ? tok : num_tokens - 1;
    const int64_t u = sub_idx < num_subs ? sub_idx : num_subs - 1;
    const int4* src = reinterpret_cast<const int4*>(xq + t * input_size + u * kSubSize);
    xv[i][0] = src[0];
    xv[i][1] = src[1];
    ds[i] = xds[t * num_subs + u];
  }

#pragma unroll
  for (int i = 0; i < kWJobs; ++i) {
    const int job = threadIdx.x + i * kThreads;
    const int r = job / kMmqSubs, j = job % kMmqSubs;
    const uint32_t keep = w_valid[i] ? 0xffffffffu : 0u;
    const float f = w_valid[i] ? 1.f : 0.f;
    uint4* dst = reinterpret_cast<uint4*>(&sm.w[r][j * kSubSize]);
    dst[0] = make_uint4(w[i].q[0] & keep, w[i].q[1] & keep, w[i].q[2] & keep, w[i].q[3] & keep);
    dst[1] = make_uint4(w[i].q[4] & keep, w[i].q[5] & keep, w[i].q[6] & keep, w[i].q[7] & keep);
    if constexpr (kScalePer32<TYPE>) {
      sm.w_sb[r][j] = make_float2(f * w[i].scale[0], f * w[i].bias[0]);
    } else {
      sm.w_sb[r][2 * j] = make_float2(f * w[i].scale[0], f * w[i].bias[0]);
      sm.w_sb[r][2 * j + 1] = make_float2(f * w[i].scale[1], f * w[i].bias[1]);
    }
  }
#pragma unroll
  for (int i = 0; i < kXJobs; ++i) {
    const int job = threadIdx.x + i * kThreads;
    const int t = job / kMmqSubs, j = job % kMmqSubs;
    const int4 zero = make_int4(0, 0, 0, 0);
    int4* dst = reinterpret_cast<int4*>(&sm.x[t][j * kSubSize]);
    dst[0] = x_valid[i] ? xv[i][0] : zero;
    dst[1] = x_valid[i] ? xv[i][1] : zero;
    const float f = x_valid[i] ? 1.f : 0.f;
    if constexpr (kScalePer32<TYPE>) {
      sm.x_ds[t][j] = make_float2(f * ds[i].d, f * (ds[i].s[0] + ds[i].s[1]));
    } else {
      sm.x_ds[t][2 * j] = make_float2(f * ds[i].d, f * ds[i].s[0]);
      sm.x_ds[t][2 * j + 1] = make_float2(f * ds[i].d, f * ds[i].s[1]);
    }
  }
}

//   out:    [num_tokens, output_size] (row stride out_stride), of out_dtype
//   weight: [output_size, input_size / kBlockSize blocks] (row stride weight_row_stride_bytes)
//   xq:     [num_tokens, input_size] int8,  xds: [num_tokens, input_size / 32]
// grid: (ceil(num_tokens / 32), ceil(output_size / (16 * WARPS)))
template <int TYPE, int WARPS>
__global__ void __launch_bounds__(WARPS* kWarpSize)
    mul_mat_kernel(void* __restrict__ out, DType out_dtype, const uint8_t* __restrict__ weight,
                   const int8_t* __restrict__ xq, const Q81Scale* __restrict__ xds,
                   int64_t num_tokens, int64_t output_size, int64_t input_size,
                   int64_t weight_row_stride_bytes, int64_t out_stride) {
  constexpr int kTokenTiles = kMmqTokens / 8;
  constexpr int kGroupSize = kScalePer32<TYPE> ? 32 : 16;  // weights per (scale, bias) pair
  constexpr int kGroups = kMmqK / kGroupSize;
  constexpr int kMmqRows = MmqSmem<WARPS>::kRows;
  __shared__ MmqSmem<WARPS> sm;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, tq = lane % 4;  // mma fragment coordinates: groupID, thread in group
  // Token tiles vary fastest: the blocks that share a row tile run together and read its weight
  // blocks from DRAM about once (the activation is small enough to stay in L2).
  const int64_t tok0 = int64_t(blockIdx.x) * kMmqTokens;
  const int64_t row0 = int64_t(blockIdx.y) * kMmqRows;
  const int wr = warp * 16 + g;  // this thread's rows wr and wr + 8 within the tile

  float acc[kTokenTiles][4] = {};
  for (int64_t k0 = 0; k0 < input_size; k0 += kMmqK) {
    mmq_fill<TYPE, WARPS>(sm, weight, xq, xds, row0, tok0, k0, num_tokens, output_size, input_size,
                          weight_row_stride_bytes);
    __syncthreads();
#pragma unroll 2
    for (int kg = 0; kg < kGroups; ++kg) {
      // The group's k16 steps accumulate in int32, then fold into fp32 with its scales.
      int c[kTokenTiles][4] = {};
#pragma unroll
      for (int ks = 0; ks < kGroupSize / 16; ++ks) {
        const int col = kg * kGroupSize + ks * 16 + 4 * tq;
        const uint32_t a0 = *reinterpret_cast<const uint32_t*>(&sm.w[wr][col]);
        const uint32_t a1 = *reinterpret_cast<const uint32_t*>(&sm.w[wr + 8][col]);
#pragma unroll
        for (int nt = 0; nt < kTokenTiles; ++nt) {
          const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&sm.x[nt * 8 + g][col]);
          mma_s8_16816(c[nt], a0, a1, b0);
        }
      }
      const float2 sb0 = sm.w_sb[wr][kg], sb1 = sm.w_sb[wr + 8][kg];
#pragma unroll
      for (int nt = 0; nt < kTokenTiles; ++nt) {
        const float2 x0 = sm.x_ds[nt * 8 + 2 * tq][kg], x1 = sm.x_ds[nt * 8 + 2 * tq + 1][kg];
        acc[nt][0] += sb0.x * x0.x * float(c[nt][0]) + sb0.y * x0.y;
        acc[nt][1] += sb0.x * x1.x * float(c[nt][1]) + sb0.y * x1.y;
        acc[nt][2] += sb1.x * x0.x * float(c[nt][2]) + sb1.y * x0.y;
        acc[nt][3] += sb1.x * x1.x * float(c[nt][3]) + sb1.y * x1.y;
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int nt = 0; nt < kTokenTiles; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = row0 + wr + (i >= 2 ? 8 : 0);
      const int64_t tok = tok0 + nt * 8 + 2 * tq + (i % 2);
      if (row < output_size && tok < num_tokens) {
        store_as(out, out_dtype, tok * out_stride + row, acc[nt][i]);
      }
    }
  }
}

// 64-row tiles (4 warps), or 32-row tiles (2 warps) where that leaves fewer than 256 thread
// blocks: with few tokens the 64-row grid of a 4096-row weight is 64 blocks, half the H100's
// SMs, each walking all of K alone.
template <int TYPE>
cudaError_t launch_mul_mat(void* out, DType out_dtype, const uint8_t* weight, const int8_t* xq,
                           const Q81Scale* xds, int64_t num_tokens, int64_t output_size,
                           int64_t input_size, int64_t weight_row_stride_bytes, int64_t out_stride,
                           cudaStream_t stream) {
  static_assert(sizeof(MmqSmem<4>) <= 48 * 1024, "static shared memory limit");
  const int64_t token_tiles = (num_tokens + kMmqTokens - 1) / kMmqTokens;
  const int64_t big_tiles = (output_size + 63) / 64;
  const bool small = big_tiles * token_tiles < 256;
  const int rows_per_tile = small ? 32 : 64;
  const int64_t row_tiles = (output_size + rows_per_tile - 1) / rows_per_tile;
  if (row_tiles > 65535) {
    PYORCH_INVALID("gguf_mul_mat: %lld weight rows are too many (at most %d)",
                   static_cast<long long>(output_size), 65535 * rows_per_tile);
  }
  const dim3 grid(static_cast<unsigned>(token_tiles), static_cast<unsigned>(row_tiles));
  if (small) {
    mul_mat_kernel<TYPE, 2><<<grid, 2 * kWarpSize, 0, stream>>>(
        out, out_dtype, weight, xq, xds, num_tokens, output_size, input_size,
        weight_row_stride_bytes, out_stride);
  } else {
    mul_mat_kernel<TYPE, 4><<<grid, 4 * kWarpSize, 0, stream>>>(
        out, out_dtype, weight, xq, xds, num_tokens, output_size, input_size,
        weight_row_stride_bytes, out_stride);
  }
  return cudaGetLastError();
}

}  // namespace pyorch::kernels::gguf
