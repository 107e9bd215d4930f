// Skinny GEMM for decode: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= 16, with optional
// fusions around it (SkinnyGemmArgs::norm_weight, SkinnyGemmEpilogue) that take the decoder
// layer's RMSNorm, SiLU-and-mul and residual add out of their own kernels.
//
// At M <= 16 a linear layer is a stream of its weight: N * K * 2 bytes read once, ~2 * M flops per
// weight element. The kernel's whole job is to keep enough weight bytes in flight on every SM
// and to spend nothing else: no split-K pass, no tile padding of M to 64 or 128.
//
// Work split. A thread block owns kSkinnyRows = 16 weight rows (16 output columns) and all of K,
// so each output is summed by one block in a fixed order: deterministic, no second kernel. Its
// NUM_WARPS warps take turns over K in 128-wide slices: warp w reads slices w, w + NUM_WARPS, ...,
// and the warps' partial sums are added in shared memory at the end, in warp order.
//
// Fragments. A slice (16 rows x 128 k of W) is multiplied on the tensor cores with mma.m16n8k16:
// W is the A operand (16 rows), x^T the B operand (8 tokens per n8 tile, M_TILES tiles). An mma
// sums over k, so any permutation of k applied to A and B alike gives the same product. We pick
// the one that makes every load a 16-byte vector: lane (g, t) = (lane / 4, lane % 4) loads chunk
// i (i < 4) = 8 consecutive k at k = slice * 128 + 32 * i + 8 * t from rows g and g + 8 and from
// token g's row of x, and feeds words 0-1 of the chunks to one mma and words 2-3 to a second
// (the fragment layout puts k pairs {2t, 2t+1} and {2t+8, 2t+9} of both operands in lane (g, t)).
// The four lanes of a group read 64 contiguous bytes of a row per load, 256 per slice.
//
// Loads. Weights are read once: ld.global.nc.L1::no_allocate keeps them out of L1, optionally
// with the L2::256B prefetch hint. x is tiny and read by every block: cached in L1.
// Rows past N and tokens past M are clamped to the last valid one (their results are dropped),
// so only the K tail needs predicates.
//
// Fusions (a decode step of a Llama layer is then 6 kernels instead of 9):
// - RMSNorm of the input (norm_weight != nullptr): out = (rms_norm(x) * g) @ W^T. The block reads
//   all of x anyway, so each lane multiplies its x chunks by g before the mma (rounded to T) and
//   sums their squares; the block adds the squares of all of K and scales its fp32 sums by
//   rsqrt(mean + eps) in the epilogue. Nothing waits for the whole row before the weight stream
//   (reading the row first, as a prologue, measured slower). Rounding differs from rms_norm
//   followed by the GEMM: x * g is rounded once, instead of x * inv_rms and then the product.
// - kSiluMul: W is [gate; up] (2D rows); block b owns gate rows 8b..8b+7 and the same up rows,
//   as mma rows g and g + 8, and writes silu(gate) * up ([M, D]), each rounded to T first as
//   silu_and_mul's input would be.
// - kAdd: out += the product (rounded to T first), in place: the residual stream's add.
//
// Programmatic dependent launch. Before waiting on the kernel that produced x
// (griddepcontrol.wait, a no-op without PDL) each warp asks L2 for its first weight slices, which
// depend on nothing; and the block lets the next kernel launch early
// (griddepcontrol.launch_dependents), so a chain of GEMMs overlaps one's tail with the next's
// first loads.
#pragma once

#include <cstdint>

#include "activation/activation.cuh"  // act_fn: silu_and_mul's own SiLU
#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "pyorch/gemm.h"  // SkinnyGemmEpilogue, the C API's and the templates' one enum

namespace pyorch::kernels {

constexpr int kSkinnyRows = 16;       // weight rows per block: the mma's M
constexpr int kSkinnyChunk = 8;       // elements of one 16-byte load
constexpr int kSkinnySliceK = 128;    // k per warp slice: 4 lanes x 4 chunks x 8 elements
constexpr int kSkinnyTileTokens = 8;  // tokens per n8 tile: the mma's N
// Register cap per thread, through __launch_bounds__' min-blocks argument. Left to itself ptxas
// aims at occupancy: 52-78 registers, each load sunk next to its mma, 3-4 loads in flight per
// warp. With 128 it issues a whole batch of slices before the first mma (checked in the SASS),
// and 16 warps of 128 registers still fit per SM: ~64 KB of weight in flight per SM.
constexpr int kSkinnyMaxRegisters = 128;
constexpr int kRegistersPerSm = 64 * 1024;

template <int NUM_WARPS>
constexpr int skinny_min_blocks() {
  return kRegistersPerSm / (NUM_WARPS * 32 * kSkinnyMaxRegisters);
}

template <typename T>
struct SkinnyGemmArgs {
  T* out;           // [num_tokens, output_size] (kSiluMul: output_size / 2), row stride out_stride
  const T* input;   // [num_tokens, input_size], row stride input_stride
  const T* weight;  // [output_size, input_size], contiguous
  const T* bias;    // [output_size] or nullptr
  const T* norm_weight;  // [input_size]: RMS-norm the input with this scale; nullptr: no norm
  float eps;             // the norm's epsilon
  int64_t num_tokens;
  int64_t output_size;
  int64_t input_size;
  int64_t out_stride;
  int64_t input_stride;
  int prefetch_slices;  // slices per warp asked of L2 before the main loop (a hint only)
};

// D += A(16x16, row) * B(16x8, col) in fp32 on 16-bit operands; a/b are packed element pairs.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], uint32_t a0, uint32_t a1,
                                                            uint32_t a2, uint32_t a3, uint32_t b0,
                                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], uint32_t a0, uint32_t a1,
                                                     uint32_t a2, uint32_t a3, uint32_t b0,
                                                     uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The loads are volatile asm, as the mmas are: volatile statements keep their program order, so
// every load of a batch is issued before the first mma waits on one. (As plain loads, the
// compiler sank each next to its use: 3-4 loads in flight per warp instead of a slice's 12-16.)

// 16 bytes of weight, read once: no L1 allocation, optionally a 256-byte L2 prefetch hint.
template <bool L2_PREFETCH>
__device__ __forceinline__ uint4 load_weight_chunk(const void* ptr) {
  uint4 v;
  if constexpr (L2_PREFETCH) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
  }
  return v;
}

// 16 bytes of x: read by every block, so cached in L1.
__device__ __forceinline__ uint4 load_input_chunk(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}

// One lane's share of a 16 x 128 weight slice and of the matching x columns.
template <int M_TILES>
struct SkinnySlice {
  uint4 w_lo[4];        // row g, chunks i = 0..3
  uint4 w_hi[4];        // row g + 8
  uint4 x[M_TILES][4];  // token (tile * 8 + g), same chunks

  // k: this lane's first element of the slice (slice * 128 + 8 * t). With PRED, chunks at or
  // past input_size read as zeros (the K tail).
  template <bool PRED, bool L2_PREFETCH, typename T>
  __device__ __forceinline__ void load(const T* w_lo_row, const T* w_hi_row,
                                       const T* const (&x_rows)[M_TILES], int64_t k,
                                       int64_t input_size) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t ki = k + 32 * i;
      const bool valid = !PRED || ki < input_size;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      w_lo[i] = valid ? load_weight_chunk<L2_PREFETCH>(w_lo_row + ki) : zero;
      w_hi[i] = valid ? load_weight_chunk<L2_PREFETCH>(w_hi_row + ki) : zero;
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        x[mt][i] = valid ? load_input_chunk(x_rows[mt] + ki) : zero;
      }
    }
  }

  // The norm's share of the slice: sum_sq[mt] += x^2 over this lane's chunks, then x *= g
  // (rounded to T). g's chunks (k as in load; zeros past input_size) are read through L1.
  template <bool PRED, typename T>
  __device__ __forceinline__ void apply_norm(const T* norm_weight, int64_t k, int64_t input_size,
                                             float (&sum_sq)[M_TILES]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t ki = k + 32 * i;
      const bool valid = !PRED || ki < input_size;
      // A plain load (not volatile asm like the stream's): ptxas may place it late, so that
      // the next slice's weight loads still go out before this slice's math.
      const uint4 gv =
          valid ? __ldg(reinterpret_cast<const uint4*>(norm_weight + ki)) : make_uint4(0, 0, 0, 0);
      const T* gp = reinterpret_cast<const T*>(&gv);
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        T* xp = reinterpret_cast<T*>(&x[mt][i]);
#pragma unroll
        for (int j = 0; j < kSkinnyChunk; ++j) {
          const float f = to_float(xp[j]);
          sum_sq[mt] = fmaf(f, f, sum_sq[mt]);
          xp[j] = from_float<T>(f * to_float(gp[j]));
        }
      }
    }
  }

  template <typename T>
  __device__ __forceinline__ void multiply(float (&acc)[M_TILES][4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        mma_m16n8k16<T>(acc[mt], w_lo[i].x, w_hi[i].x, w_lo[i].y, w_hi[i].y, x[mt][i].x,
                        x[mt][i].y);
        mma_m16n8k16<T>(acc[mt], w_lo[i].z, w_hi[i].z, w_lo[i].w, w_hi[i].w, x[mt][i].z,
                        x[mt][i].w);
      }
    }
  }
};

// Grid: one block per 16 weight rows (kSiluMul: per 8 gate rows and their 8 up rows). Block:
// NUM_WARPS warps splitting K. M_TILES = ceil(num_tokens / 8). One slice is loaded per loop
// iteration; ptxas software-pipelines the loop (the next slice's 12-16 loads are in flight while
// this one is multiplied), so an explicit unroll of two slices only cost registers (measured
// slower on every shape).
template <typename T, int M_TILES, int NUM_WARPS, bool L2_PREFETCH, bool NORM,
          SkinnyGemmEpilogue EPI>
__global__ void __launch_bounds__(NUM_WARPS* kWarpSize, skinny_min_blocks<NUM_WARPS>())
    skinny_gemm_kernel(const SkinnyGemmArgs<T> args) {
  constexpr int kTokens = M_TILES * kSkinnyTileTokens;
  constexpr bool kPaired = EPI == SkinnyGemmEpilogue::kSiluMul;
  __shared__ float partial[NUM_WARPS][kTokens][kSkinnyRows];  // each warp's sums
  __shared__ float partial_sq[NUM_WARPS][kTokens];            // each warp's sums of x^2 (NORM)

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  const int64_t K = args.input_size;
  // Plain: rows row0 .. row0 + 15 of W, as mma rows 0 .. 15. Paired: gate rows row0 .. row0 + 7
  // (mma rows 0..7) and up rows half + row0 .. (mma rows 8..15); outputs are columns row0 + r.
  const int64_t half = kPaired ? args.output_size / 2 : 0;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * (kPaired ? kSkinnyRows / 2 : kSkinnyRows);
  const int64_t last_row = (kPaired ? half : args.output_size) - 1;
  const T* w_lo_row;
  const T* w_hi_row;
  if constexpr (kPaired) {
    const int64_t r = min(row0 + g, last_row);
    w_lo_row = args.weight + r * K;
    w_hi_row = args.weight + (half + r) * K;
  } else {
    w_lo_row = args.weight + min(row0 + g, last_row) * K;
    w_hi_row = args.weight + min(row0 + g + 8, last_row) * K;
  }
  const T* x_rows[M_TILES];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
    const int64_t token =
        min(static_cast<int64_t>(mt * kSkinnyTileTokens + g), args.num_tokens - 1);
    x_rows[mt] = args.input + token * args.input_stride;
  }

  const int num_slices = static_cast<int>((K + kSkinnySliceK - 1) / kSkinnySliceK);
  const int num_full_slices = static_cast<int>(K / kSkinnySliceK);
  const int64_t lane_k = kSkinnyChunk * t;

  // The first slices' weight lines (two 128-byte lines per row per slice), asked of L2 before x
  // is ready: under PDL this overlaps the previous kernel's tail, and in any case it puts more
  // bytes in flight than the registers can hold while the pipeline fills.
  for (int j = 0; j < args.prefetch_slices; ++j) {
    const int64_t k = static_cast<int64_t>(warp + j * NUM_WARPS) * kSkinnySliceK + 32 * t;
    if (k < K) {
      prefetch_l2(w_lo_row + k);
      prefetch_l2(w_hi_row + k);
    }
  }
  pdl_wait();
  pdl_launch_dependents();

  float acc[M_TILES][4] = {};
  float sum_sq[M_TILES] = {};
  int slice = warp;
  if constexpr (NORM) {
    // Pipelined by hand: the next slice's loads are issued before this slice's norm math and
    // mmas (left to itself, ptxas kept one slice in flight here, against about two without the
    // norm).
    if (slice < num_full_slices) {
      SkinnySlice<M_TILES> cur;
      cur.template load<false, L2_PREFETCH>(
          w_lo_row, w_hi_row, x_rows, static_cast<int64_t>(slice) * kSkinnySliceK + lane_k, K);
      while (true) {
        const int next = slice + NUM_WARPS;
        const bool more = next < num_full_slices;
        SkinnySlice<M_TILES> nxt;
        if (more) {
          nxt.template load<false, L2_PREFETCH>(
              w_lo_row, w_hi_row, x_rows, static_cast<int64_t>(next) * kSkinnySliceK + lane_k, K);
        }
        cur.template apply_norm<false>(
            args.norm_weight, static_cast<int64_t>(slice) * kSkinnySliceK + lane_k, K, sum_sq);
        cur.template multiply<T>(acc);
        slice = next;
        if (!more) break;
        cur = nxt;
      }
    }
  } else {
    for (; slice < num_full_slices; slice += NUM_WARPS) {
      SkinnySlice<M_TILES> s;
      s.template load<false, L2_PREFETCH>(w_lo_row, w_hi_row, x_rows,
                                          static_cast<int64_t>(slice) * kSkinnySliceK + lane_k, K);
      s.template multiply<T>(acc);
    }
  }
  if (slice < num_slices) {  // the partial slice of a K tail (K % 128 != 0)
    SkinnySlice<M_TILES> s;
    const int64_t k = static_cast<int64_t>(slice) * kSkinnySliceK + lane_k;
    s.template load<true, L2_PREFETCH>(w_lo_row, w_hi_row, x_rows, k, K);
    if constexpr (NORM) s.template apply_norm<true>(args.norm_weight, k, K, sum_sq);
    s.template multiply<T>(acc);
  }

  // acc[mt] holds rows (g, g + 8) x tokens (mt * 8 + 2t, + 1): the mma's C fragment.
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int token = mt * kSkinnyTileTokens + 2 * t + j;
      partial[warp][token][g] = acc[mt][j];
      partial[warp][token][g + 8] = acc[mt][2 + j];
    }
  }
  if constexpr (NORM) {
    // Lanes (g, 0..3) hold the squares of token g's chunks of this warp's slices.
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      float v = sum_sq[mt];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (t == 0) partial_sq[warp][mt * kSkinnyTileTokens + g] = v;
    }
  }
  __syncthreads();
  // One thread per output, consecutive threads on consecutive columns; warps summed in order.
  constexpr int kCols = kPaired ? kSkinnyRows / 2 : kSkinnyRows;
  const int num_outputs = static_cast<int>(args.num_tokens) * kCols;
  for (int idx = threadIdx.x; idx < num_outputs; idx += NUM_WARPS * kWarpSize) {
    const int token = idx / kCols;
    const int r = idx % kCols;
    const int64_t row = row0 + r;
    if (row > last_row) continue;
    float scale = 1.f;
    if constexpr (NORM) {
      float sq = 0.f;
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) sq += partial_sq[w][token];
      scale = rsqrtf(sq / static_cast<float>(K) + args.eps);
    }
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) sum += partial[w][token][r];
    sum *= scale;
    if (args.bias != nullptr) sum += to_float(args.bias[row]);
    T* out = args.out + token * args.out_stride + row;
    if constexpr (kPaired) {
      float up = 0.f;
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) up += partial[w][token][r + 8];
      up *= scale;
      if (args.bias != nullptr) up += to_float(args.bias[half + row]);
      *out = from_float<T>(act_fn<Activation::kSilu>(to_float(from_float<T>(sum))) *
                           to_float(from_float<T>(up)));
    } else if constexpr (EPI == SkinnyGemmEpilogue::kAdd) {
      *out = from_float<T>(to_float(from_float<T>(sum)) + to_float(*out));
    } else {
      *out = from_float<T>(sum);
    }
  }
}

template <typename T, int M_TILES, int NUM_WARPS, bool NORM, SkinnyGemmEpilogue EPI>
cudaError_t launch_skinny_gemm_variant(const SkinnyGemmArgs<T>& args, bool l2_prefetch, bool pdl,
                                       cudaStream_t stream) {
  constexpr int64_t kRowsPerBlock =
      EPI == SkinnyGemmEpilogue::kSiluMul ? kSkinnyRows / 2 : kSkinnyRows;
  const int64_t rows =
      EPI == SkinnyGemmEpilogue::kSiluMul ? args.output_size / 2 : args.output_size;
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  const dim3 block(NUM_WARPS * kWarpSize);
  if (l2_prefetch) {
    return launch_kernel(&skinny_gemm_kernel<T, M_TILES, NUM_WARPS, true, NORM, EPI>, grid, block,
                         0, stream, pdl, args);
  }
  return launch_kernel(&skinny_gemm_kernel<T, M_TILES, NUM_WARPS, false, NORM, EPI>, grid, block, 0,
                       stream, pdl, args);
}

template <typename T, int M_TILES, bool NORM, SkinnyGemmEpilogue EPI>
cudaError_t launch_skinny_gemm_tiles(const SkinnyGemmArgs<T>& args, int num_warps, bool l2_prefetch,
                                     bool pdl, cudaStream_t stream) {
  switch (num_warps) {
    case 4:
      return launch_skinny_gemm_variant<T, M_TILES, 4, NORM, EPI>(args, l2_prefetch, pdl, stream);
    case 8:
      return launch_skinny_gemm_variant<T, M_TILES, 8, NORM, EPI>(args, l2_prefetch, pdl, stream);
    case 16:
      return launch_skinny_gemm_variant<T, M_TILES, 16, NORM, EPI>(args, l2_prefetch, pdl, stream);
    default: PYORCH_INVALID("skinny_gemm: unsupported num_warps %d (4, 8 or 16)", num_warps);
  }
}

}  // namespace pyorch::kernels
