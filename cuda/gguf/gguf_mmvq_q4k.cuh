// gguf_mul_mat_vec's direct one-token form for Q4_K rows that start on 16 bytes (every Q4_K row
// of a GGUF file: 144-byte blocks, 32-byte aligned tensors). No shared-memory ring: four lanes
// share a block, each loading 32 bytes of its quants (two whole sub-blocks: the low and the high
// nibbles) and one word of its 16-byte header (d, dmin, the packed scales) straight into
// registers; a warp step is eight blocks (1152 bytes), and a warp's next step is in flight while
// it multiplies the current one. x is rounded to q8_1 (the arithmetic and bits of
// quantize_q8_1_kernel) by each thread block into shared memory first.
//
// Why a second form: the ring kernel (gguf_mmvq.cuh) spends ~350 warp instructions per 1152
// bytes of Q4_K (a lane decodes 16 bytes of quants that another lane also reads, the 6-bit scales
// byte by byte behind a branch that splits the warp, and the ring's copies and waits), and runs
// at the same time per layer on an H100 and an H200: bound by instructions, not by memory (H200,
// a Llama-3-8B layer's four products at M = 1: 59.4 us, 49% of the copy bandwidth). Here the
// header's three scale words give both sub-blocks' scales in a dozen ALU operations, the high
// nibbles enter dp4a unshifted (16 q, the 1/16 folded into the scale), and the small integers
// become floats by exponent arithmetic instead of the quarter-rate I2F.
//
// x in shared memory, per group g of two sub-blocks (block g / 4, pair g % 4): its 64 int8 at
// g * 80 (16 bytes of padding: the eight lanes of a quarter warp, groups g .. g + 7, then read
// eight different 16-byte bank groups) and {d, d * sum(q)} of each sub-block at the 16 bytes
// g * 16 of the scale array.
//
// Fused input and output (gguf_mul_mat_vec_fused, the engine's decode layer): the product may
// take rms_norm(x) * g or silu(x[:K]) * x[K:] instead of x, each value rounded as the rms_norm /
// silu_and_mul kernels round it, formed by the lanes that round it to q8_1 (eight a sub-block);
// and it may add into `out` (the residual stream: out = out + the product rounded to out's
// dtype, as fused_add_rms_norm's add). A Llama decoder layer is then 6 kernels instead of 9: no
// fused_add_rms_norm and no silu_and_mul.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>

#include "activation/activation.cuh"  // act_fn: silu_and_mul's own SiLU
#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "gguf/gguf_blocks.cuh"
#include "gguf/gguf_mmvq.cuh"
#include "gguf/gguf_q8_1.cuh"
#include "pyorch/gguf.h"  // GgufInputOp

namespace pyorch::kernels::gguf {

constexpr int kQ4KBlockBytes = 144;
constexpr int kQ4KLanesPerBlock = 4;                              // a lane per sub-block pair
constexpr int kQ4KBlocksPerStep = kWarpSize / kQ4KLanesPerBlock;  // 8: 1152 bytes per warp step
constexpr int kQ4KXGroupBytes = 80;  // x's 64 int8 of one sub-block pair, padded (banks)
constexpr int kQ4KMaxWarps = 32;     // rows in flight per thread block, at most

// Shared memory of one thread block: x's padded int8 groups, then a float4 per group; with the
// RMSNorm input op, then the warps' partial sums of squares (kQ4KMaxWarps floats).
constexpr size_t q4k_mul_mat_vec_smem(int64_t input_size,
                                      GgufInputOp input_op = GgufInputOp::kNone) {
  return size_t(input_size / 64) * (kQ4KXGroupBytes + 16) +
         (input_op == GgufInputOp::kRmsNorm ? sizeof(float) * kQ4KMaxWarps : 0);
}

// Lanes that round one 32-value sub-block of x to q8_1 (4 values each, a group of consecutive
// lanes of a warp), and the values a lane holds.
constexpr int kQ4KXLanes = 8;
constexpr int kQ4KXPerLane = kSubSize / kQ4KXLanes;

// Calls f(T{}) with x's element type.
template <class F>
__device__ __forceinline__ void with_float_type(DType dtype, F&& f) {
  if (dtype == DType::kFloat16) {
    f(__half{});
  } else if (dtype == DType::kBFloat16) {
    f(__nv_bfloat16{});
  } else {
    f(float{});
  }
}

// Four consecutive values of T at p (aligned to their size) as floats.
template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&v)[kQ4KXPerLane]) {
  if constexpr (sizeof(T) == 4) {
    const float4 r = *reinterpret_cast<const float4*>(p);
    v[0] = r.x, v[1] = r.y, v[2] = r.z, v[3] = r.w;
  } else {
    const uint2 r = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
    for (int i = 0; i < kQ4KXPerLane; ++i) v[i] = to_float(e[i]);
  }
}

// x rounded to q8_1 into the block's shared memory (x_groups, x_scales: the layout at the top of
// this file) by all its threads, kQ4KXLanes lanes a sub-block: the values and bits of
// quantize_q8_1_kernel (the max, d = max / 127, q = round(v * (1 / d)), exact integer sums),
// where a thread rounding whole sub-blocks alone was a chain of 32 values per thread. With an
// input op the values are first formed as their kernels form them: kRmsNorm T(T(x * inv_rms) * g)
// (rms_norm_kernel's roundings; the sum of squares is reduced through red in a fixed order),
// kSiluAndMul T(silu(x[i]) * x[K + i]) (act_and_mul_kernel's). The caller synchronizes after.
template <GgufInputOp IN, typename T>
__device__ __forceinline__ void round_x_to_q8_1(const T* __restrict__ x, const T* __restrict__ g,
                                                float eps, int64_t input_size, int8_t* x_groups,
                                                float4* x_scales, float* red) {
  const int num_subs = static_cast<int>(input_size / kSubSize);
  const int groups = blockDim.x / kQ4KXLanes;  // sub-blocks rounded at a time
  const int rounds = (num_subs + groups - 1) / groups;
  const int li = threadIdx.x % kQ4KXLanes;
  float inv_rms = 0.f;
  if constexpr (IN == GgufInputOp::kRmsNorm) {
    float sum_sq = 0.f;
    for (int r = 0; r < rounds; ++r) {
      const int j = r * groups + static_cast<int>(threadIdx.x) / kQ4KXLanes;
      if (j < num_subs) {
        float v[kQ4KXPerLane];
        load4(x + int64_t(j) * kSubSize + li * kQ4KXPerLane, v);
#pragma unroll
        for (int i = 0; i < kQ4KXPerLane; ++i) sum_sq += v[i] * v[i];
      }
    }
    sum_sq = warp_reduce_sum(sum_sq);
    if (threadIdx.x % kWarpSize == 0) red[threadIdx.x / kWarpSize] = sum_sq;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < static_cast<int>(blockDim.x / kWarpSize); ++w) total += red[w];
    inv_rms = rsqrtf(total / static_cast<float>(input_size) + eps);
  }
  for (int r = 0; r < rounds; ++r) {  // every lane takes part in the shuffles
    const int j = r * groups + static_cast<int>(threadIdx.x) / kQ4KXLanes;
    const bool valid = j < num_subs;
    const int64_t k = int64_t(j) * kSubSize + li * kQ4KXPerLane;
    float v[kQ4KXPerLane] = {0.f, 0.f, 0.f, 0.f};
    if (valid) {
      load4(x + k, v);
      if constexpr (IN == GgufInputOp::kRmsNorm) {
        float w[kQ4KXPerLane];
        load4(g + k, w);
#pragma unroll
        for (int i = 0; i < kQ4KXPerLane; ++i) {
          const float normed = to_float(from_float<T>(v[i] * inv_rms));
          v[i] = to_float(from_float<T>(normed * w[i]));
        }
      } else if constexpr (IN == GgufInputOp::kSiluAndMul) {
        float up[kQ4KXPerLane];
        load4(x + input_size + k, up);
#pragma unroll
        for (int i = 0; i < kQ4KXPerLane; ++i) {
          v[i] = to_float(from_float<T>(act_fn<Activation::kSilu>(v[i]) * up[i]));
        }
      }
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kQ4KXPerLane; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 1; o < kQ4KXLanes; o *= 2) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
    const float d = amax / 127.f;
    const float inv_d = d == 0.f ? 0.f : 1.f / d;
    uint32_t word = 0;
    int sum = 0;  // exact: |sum| <= 16 * 127
#pragma unroll
    for (int i = 0; i < kQ4KXPerLane; ++i) {
      const int q = __float2int_rn(v[i] * inv_d);
      sum += q;
      word |= (uint32_t(q) & 0xffu) << (8 * i);
    }
    // The two 16-value halves' sums (lanes 0-3, 4-7), then both in the group's first lane.
    sum += __shfl_xor_sync(~0u, sum, 1);
    sum += __shfl_xor_sync(~0u, sum, 2);
    sum += __shfl_xor_sync(~0u, sum, 4);
    if (valid) {
      *reinterpret_cast<uint32_t*>(x_groups + (j / 2) * kQ4KXGroupBytes + (j % 2) * kSubSize +
                                   li * kQ4KXPerLane) = word;
      if (li == 0) {
        float* s = reinterpret_cast<float*>(x_scales + j / 2) + 2 * (j % 2);
        s[0] = d;
        s[1] = d * static_cast<float>(sum);
      }
    }
  }
}

// out[idx] as a float (the residual stream's value that an accumulating product adds to).
__device__ __forceinline__ float load_as_float(const void* out, DType dtype, int64_t idx) {
  switch (dtype) {
    case DType::kFloat16: return __half2float(static_cast<const __half*>(out)[idx]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(out)[idx]);
    default: return static_cast<const float*>(out)[idx];
  }
}

// out[idx] = prior + v, v rounded to out's dtype first, the sum rounded once (the residual
// stream's add, as fused_add_rms_norm rounds it); prior is out[idx] read earlier.
__device__ __forceinline__ void store_sum_as(void* out, DType dtype, int64_t idx, float v,
                                             float prior) {
  switch (dtype) {
    case DType::kFloat16:
      static_cast<__half*>(out)[idx] = __float2half_rn(__half2float(__float2half_rn(v)) + prior);
      break;
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(out)[idx] =
          __float2bfloat16_rn(__bfloat162float(__float2bfloat16_rn(v)) + prior);
      break;
    default: static_cast<float*>(out)[idx] = v + prior; break;
  }
}

// Byte `byte` (0..3) of v as a float, exactly: the byte under the exponent of 2^23 (one byte
// permute: selector 0x744b puts byte b low, zeros above it and 0x4b on top), minus 2^23.
__device__ __forceinline__ float byte_to_float(uint32_t v, uint32_t byte) {
  return __uint_as_float(__byte_perm(v, 0x4b000000u, 0x7440u | byte)) - 8388608.f;
}
// |v| < 2^22 as a float, exactly.
__device__ __forceinline__ float small_int_to_float(int v) {
  return __int_as_float(0x4b400000 + v) - 12582912.f;
}
// c + the dot product of a's four unsigned bytes with b's four signed bytes.
__device__ __forceinline__ int dp4a_us(uint32_t a, int b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// 4 bytes of a weight's header, on the read-only path (16: load_weight_chunk, common/vec.cuh);
// L2_256: the L2::256B prefetch hint.
template <bool L2_256>
__device__ __forceinline__ uint32_t ldg_4(const void* p) {
  uint32_t v;
  if constexpr (L2_256) {
    asm volatile("ld.global.nc.L2::256B.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  } else {
    asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  }
  return v;
}

// One lane's registers for one warp step: its 32 quant bytes and one header word.
struct Q4KLaneStep {
  uint4 lo, hi;    // qs[32 pair .. + 15], qs[32 pair + 16 .. + 31]
  uint32_t hword;  // header word lane % 4 of the lane's block
};

// out[row] = x . dequantize(weight[row]) for one token, blockDim.x / 32 warps per thread block,
// each warp taking rows row0, row0 + gridDim.x * warps, ... as a sequence of 8-block steps.
//   out:    [output_size] of out_dtype (output_size <= 2^30: the launcher checks)
//   weight: [output_size, input_size / 256 blocks] (row stride row_stride_bytes, a multiple of
//           16, weight 16-byte aligned)
//   x:      [input_size] of out_dtype, 16-byte aligned ([2 * input_size] for kSiluAndMul)
//   norm_weight: [input_size] of out_dtype, 16-byte aligned (kRmsNorm; eps its epsilon)
//   accumulate: out[row] += the product (rounded to out_dtype first) instead of out[row] = it
template <bool L2_256, GgufInputOp IN = GgufInputOp::kNone>
__global__ void __launch_bounds__(kQ4KMaxWarps* kWarpSize, 1)
    q4k_mul_mat_vec_kernel(void* __restrict__ out, DType out_dtype,
                           const uint8_t* __restrict__ weight, const void* __restrict__ x,
                           int output_size, int64_t input_size, int64_t row_stride_bytes,
                           const void* __restrict__ norm_weight, float eps, bool accumulate) {
  extern __shared__ uint4 q4k_smem[];
  auto* x_groups = reinterpret_cast<int8_t*>(q4k_smem);
  auto* x_scales = reinterpret_cast<float4*>(x_groups + (input_size / 64) * kQ4KXGroupBytes);
  const int warps = blockDim.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int row_step = static_cast<int>(gridDim.x) * warps;
  const int blocks_per_row = static_cast<int>(input_size / 256);
  const int steps_per_row = (blocks_per_row + kQ4KBlocksPerStep - 1) / kQ4KBlocksPerStep;
  const int lane_block = lane / kQ4KLanesPerBlock;
  const int pair = lane % kQ4KLanesPerBlock;

  // The warp's (row, step) sequence: issued (loads into registers) at (row, step), multiplied at
  // (use_row, use_step), two steps behind, so one step is in flight while another is multiplied.
  int row = static_cast<int>(blockIdx.x) * warps + static_cast<int>(threadIdx.x) / kWarpSize;
  int step = 0;
  int use_row = row, use_step = 0;
  auto issue_step = [&](Q4KLaneStep& g) {
    const int block = step * kQ4KBlocksPerStep + lane_block;
    if (row < output_size && block < blocks_per_row) {
      const uint8_t* b = weight + int64_t(row) * row_stride_bytes + block * kQ4KBlockBytes;
      g.hword = ldg_4<L2_256>(b + 4 * pair);
      g.lo = load_weight_chunk<L2_256>(b + 16 + 32 * pair);
      g.hi = load_weight_chunk<L2_256>(b + 32 + 32 * pair);
    } else {  // past the row's blocks: d = dmin = 0 adds nothing
      g.hword = 0;
      g.lo = g.hi = make_uint4(0, 0, 0, 0);
    }
    if (++step == steps_per_row) {
      step = 0;
      row += row_step;
    }
  };
  const int base = lane & ~(kQ4KLanesPerBlock - 1);  // the block's first lane
  float acc = 0.f;
  float prior = 0.f;  // accumulate: out[use_row] (lane 0), read after pdl_wait
  auto use_step_of = [&](const Q4KLaneStep& w) {
    if (use_row >= output_size) return;  // uniform across the warp
    const int block = use_step * kQ4KBlocksPerStep + lane_block;
    const int group = (block < blocks_per_row ? block : 0) * kQ4KLanesPerBlock + pair;
    const int8_t* xg = x_groups + group * kQ4KXGroupBytes;
    const int4 x0 = *reinterpret_cast<const int4*>(xg);       // even sub-block, 0..15
    const int4 x1 = *reinterpret_cast<const int4*>(xg + 16);  // even sub-block, 16..31
    const int4 x2 = *reinterpret_cast<const int4*>(xg + 32);  // odd sub-block, 0..15
    const int4 x3 = *reinterpret_cast<const int4*>(xg + 48);  // odd sub-block, 16..31
    const float4 ds = x_scales[group];                        // d0, d0 * sum0, d1, d1 * sum1
    constexpr uint32_t kLo = 0x0f0f0f0fu, kHi = 0xf0f0f0f0u;
    // Quant word i holds values 4 i .. 4 i + 3 of both sub-blocks (low / high nibbles).
    const uint32_t qw[8] = {w.lo.x, w.lo.y, w.lo.z, w.lo.w, w.hi.x, w.hi.y, w.hi.z, w.hi.w};
    const int xe[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    const int xo[8] = {x2.x, x2.y, x2.z, x2.w, x3.x, x3.y, x3.z, x3.w};
    int even = 0, odd16 = 0;  // odd16: 16 x the odd sub-block's product
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      even = dp4a_us(qw[i] & kLo, xe[i], even);
      odd16 = dp4a_us(qw[i] & kHi, xo[i], odd16);
    }
    const uint32_t h0 = __shfl_sync(0xffffffffu, w.hword, base);
    const uint32_t h1 = __shfl_sync(0xffffffffu, w.hword, base + 1);
    const uint32_t h2 = __shfl_sync(0xffffffffu, w.hword, base + 2);
    const uint32_t h3 = __shfl_sync(0xffffffffu, w.hword, base + 3);
    uint32_t sc, m;
    q4k_pair_scale_min(h1, h2, h3, pair, sc, m);
    const float d = __half2float(__ushort_as_half(static_cast<uint16_t>(h0 & 0xffffu)));
    const float dmin = __half2float(__ushort_as_half(static_cast<uint16_t>(h0 >> 16)));
    // |even| <= 32 * 15 * 127 and |odd16| <= 32 * 240 * 127, both under 2^22.
    const float scaled = byte_to_float(sc, 0) * ds.x * small_int_to_float(even) +
                         byte_to_float(sc, 1) * 0.0625f * ds.z * small_int_to_float(odd16);
    const float mins = byte_to_float(m, 0) * ds.y + byte_to_float(m, 1) * ds.w;
    acc += d * scaled - dmin * mins;
    if (++use_step == steps_per_row) {  // the row is done (uniform)
      const float v = warp_reduce_sum(acc);
      if (lane == 0) {
        if (accumulate) {
          store_sum_as(out, out_dtype, use_row, v, prior);
        } else {
          store_as(out, out_dtype, use_row, v);
        }
      }
      acc = 0.f;
      use_step = 0;
      use_row += row_step;
      // The next row's residual value, read while the row streams (not after its last step).
      if (accumulate && lane == 0 && use_row < output_size) {
        prior = load_as_float(out, out_dtype, use_row);
      }
    }
  };

  // Under PDL the first two steps' weights are requested while the kernel before this one
  // finishes; x is its output.
  Q4KLaneStep step_a, step_b;
  issue_step(step_a);
  issue_step(step_b);
  pdl_wait();
  if (accumulate && lane == 0 && use_row < output_size) {
    prior = load_as_float(out, out_dtype, use_row);
  }
  with_float_type(out_dtype, [&](auto tag) {
    using T = decltype(tag);
    round_x_to_q8_1<IN>(static_cast<const T*>(x), static_cast<const T*>(norm_weight), eps,
                        input_size, x_groups, x_scales,
                        reinterpret_cast<float*>(x_scales + input_size / 64));
  });
  __syncthreads();
  pdl_launch_dependents();

  while (use_row < output_size) {
    use_step_of(step_a);
    issue_step(step_a);
    use_step_of(step_b);
    issue_step(step_b);
  }
}

template <bool L2_256, GgufInputOp IN = GgufInputOp::kNone>
int q4k_mul_mat_vec_resident_blocks(int warps, size_t smem) {
  auto* kernel = q4k_mul_mat_vec_kernel<L2_256, IN>;
  if (smem > 48 * 1024 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem)) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, warps * kWarpSize, smem) !=
      cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return blocks;
}

// warps: rows per thread block (1..32); max_blocks > 0 caps the grid (each block then quantizes
// x once for several rows per warp). The caller checked the alignment, that the form fits an SM,
// and output_size <= 2^30. norm_weight, eps: kRmsNorm's; accumulate: out += the product.
template <bool L2_256, GgufInputOp IN = GgufInputOp::kNone>
cudaError_t launch_q4k_mul_mat_vec(void* out, DType out_dtype, const uint8_t* weight, const void* x,
                                   int64_t output_size, int64_t input_size,
                                   int64_t row_stride_bytes, int warps, int64_t max_blocks,
                                   bool pdl, cudaStream_t stream, const void* norm_weight = nullptr,
                                   float eps = 0.f, bool accumulate = false) {
  const size_t smem = q4k_mul_mat_vec_smem(input_size, IN);
  auto* kernel = q4k_mul_mat_vec_kernel<L2_256, IN>;
  if (smem > 48 * 1024) {
    PYORCH_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(smem)));
  }
  int64_t grid = (output_size + warps - 1) / warps;
  if (max_blocks > 0 && grid > max_blocks) grid = max_blocks;
  return launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(warps * kWarpSize), smem,
                       stream, pdl, out, out_dtype, weight, x, static_cast<int>(output_size),
                       input_size, row_stride_bytes, norm_weight, eps, accumulate);
}

}  // namespace pyorch::kernels::gguf
