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
//
// Weight formats (SkinnyWeight<T, W>). W = T streams fp16/bf16 weights as above. W = e4m3
// (skinny_gemm_fp8, cuda/gemm/skinny_gemm_fp8.cu) streams one-byte weights with the same work
// split and fusions: a 16-byte load holds 16 k instead of 8, so a slice is 256 k wide (lane (g, t)
// loads k = slice * 256 + 64 * i + 16 * t, the four lanes of a group still 64 contiguous bytes of
// a row) and each weight chunk meets two x chunks (k and k + 8). The weights are widened to T in
// registers exactly (every e4m3 value is a T value) and multiplied with x as T on the same mma;
// the per-tensor or per-output-channel weight scale multiplies the fp32 sum in the epilogue.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_fp8.h>

#include "activation/activation.cuh"  // act_fn: silu_and_mul's own SiLU
#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"  // load_weight_chunk
#include "pyorch/gemm.h"   // SkinnyGemmEpilogue, the C API's and the templates' one enum

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

template <typename T, typename W = T>
struct SkinnyGemmArgs {
  T* out;           // [num_tokens, output_size] (kSiluMul: output_size / 2), row stride out_stride
  const T* input;   // [num_tokens, input_size], row stride input_stride
  const W* weight;  // [output_size, input_size], contiguous
  // W != T only: float32 weight scales, [output_size] (weight_scale_per_row) or [1]
  const float* weight_scale;
  int weight_scale_per_row;
  const T* bias;         // [output_size] or nullptr
  const T* norm_weight;  // [input_size]: RMS-norm the input with this scale; nullptr: no norm
  float eps;             // the norm's epsilon
  int64_t num_tokens;
  int64_t output_size;
  int64_t input_size;
  int64_t out_stride;
  int64_t input_stride;
  int prefetch_slices;  // slices per warp asked of L2 before the main loop (a hint only)
  // NORM with e4m3 weights and <= 8 tokens only: 1 launches the staged form (each slice's normed
  // x computed once per warp into shared memory, skinny_staged_norm_slice), 0 the per-lane norm.
  int stage_x;
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

// How a weight format is streamed: elements per 16-byte load (kElems), x chunks (8 elements) per
// weight chunk (kXChunks), K per warp slice, and widen(): x chunk c's share of a weight chunk as
// 8 values of T (packed pairs, in k order).
template <typename T, typename W>
struct SkinnyWeight {
  static constexpr int kElems = 8;
  static constexpr int kXChunks = 1;
  static constexpr int kSliceK = 16 * kElems;
  __device__ __forceinline__ static uint4 widen(const uint4& w, int /*c*/) { return w; }
};

// e4m3 -> T by bit moves and one exact multiply (no conversion instruction): a byte b placed in
// the high byte of a 16-bit lane has its sign on the lane's sign bit; its 7 exponent-and-mantissa
// bits shifted into T's exponent's low bits and mantissa's high bits give b's value times
// 2^-(bias_T - 7) for normal and subnormal b alike (T's subnormals have the same relation), so a
// multiply by 2^(bias_T - 7) (2^120 for bf16, 2^8 for fp16) makes it exact. The NaN encoding
// (0x7f / 0xff) widens to +-480 (a checkpoint's weights are finite).
template <typename T>
struct SkinnyFp8Widen;

template <>
struct SkinnyFp8Widen<__nv_bfloat16> {
  __device__ __forceinline__ static uint32_t pair(uint32_t hi_bytes) {
    const uint32_t bits = (hi_bytes & 0x80008000u) | ((hi_bytes >> 4) & 0x07f007f0u);
    const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&bits);
    const __nv_bfloat162 s = __floats2bfloat162_rn(0x1p120f, 0x1p120f);
    const __nv_bfloat162 r = __hmul2(v, s);
    return *reinterpret_cast<const uint32_t*>(&r);
  }
};

template <>
struct SkinnyFp8Widen<__half> {
  __device__ __forceinline__ static uint32_t pair(uint32_t hi_bytes) {
    const uint32_t bits = (hi_bytes & 0x80008000u) | ((hi_bytes >> 1) & 0x3f803f80u);
    const __half2 v = *reinterpret_cast<const __half2*>(&bits);
    const __half2 r = __hmul2(v, __floats2half2_rn(256.f, 256.f));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
};

template <typename T>
struct SkinnyWeight<T, __nv_fp8_e4m3> {
  static constexpr int kElems = 16;
  static constexpr int kXChunks = 2;
  static constexpr int kSliceK = 16 * kElems;
  __device__ __forceinline__ static uint4 widen(const uint4& w, int c) {
    const uint32_t lo = c == 0 ? w.x : w.z;  // bytes 8c .. 8c + 3
    const uint32_t hi = c == 0 ? w.y : w.w;  // bytes 8c + 4 .. 8c + 7
    // __byte_perm selector 0x1404: bytes (0, b0, 0, b1); 0x3424: (0, b2, 0, b3).
    return make_uint4(SkinnyFp8Widen<T>::pair(__byte_perm(lo, 0, 0x1404)),
                      SkinnyFp8Widen<T>::pair(__byte_perm(lo, 0, 0x3424)),
                      SkinnyFp8Widen<T>::pair(__byte_perm(hi, 0, 0x1404)),
                      SkinnyFp8Widen<T>::pair(__byte_perm(hi, 0, 0x3424)));
  }
};

// The loads are volatile asm, as the mmas are: volatile statements keep their program order, so
// every load of a batch is issued before the first mma waits on one. (As plain loads, the
// compiler sank each next to its use: 3-4 loads in flight per warp instead of a slice's 12-16.)

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

// One lane's share of a 16 x kSliceK weight slice and of the matching x columns.
template <int M_TILES, typename T, typename W = T>
struct SkinnySlice {
  using Fmt = SkinnyWeight<T, W>;
  static constexpr int kXPerSlice = 4 * Fmt::kXChunks;  // x chunks per lane and slice
  uint4 w_lo[4];                                        // row g, chunks i = 0..3
  uint4 w_hi[4];                                        // row g + 8
  uint4 x[M_TILES][kXPerSlice];  // token (tile * 8 + g): chunk i's x chunks c at 4 * i... + c

  // k of x chunk j (weight chunk j / kXChunks) from this lane's first element of the slice.
  __device__ __forceinline__ static int x_offset(int j) {
    return 4 * Fmt::kElems * (j / Fmt::kXChunks) + 8 * (j % Fmt::kXChunks);
  }

  // k: this lane's first element of the slice (slice * kSliceK + kElems * t). With PRED, chunks
  // at or past input_size read as zeros (the K tail; input_size is a multiple of kElems).
  template <bool PRED, bool L2_PREFETCH>
  __device__ __forceinline__ void load(const W* w_lo_row, const W* w_hi_row,
                                       const T* const (&x_rows)[M_TILES], int64_t k,
                                       int64_t input_size) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t ki = k + 4 * Fmt::kElems * i;
      const bool valid = !PRED || ki < input_size;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      w_lo[i] = valid ? load_weight_chunk<L2_PREFETCH>(w_lo_row + ki) : zero;
      w_hi[i] = valid ? load_weight_chunk<L2_PREFETCH>(w_hi_row + ki) : zero;
#pragma unroll
      for (int c = 0; c < Fmt::kXChunks; ++c) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          x[mt][i * Fmt::kXChunks + c] = valid ? load_input_chunk(x_rows[mt] + ki + 8 * c) : zero;
        }
      }
    }
  }

  // The norm's share of the slice: sum_sq[mt] += x^2 over this lane's chunks, then x *= g
  // (rounded to T). g's chunks (k as in load; zeros past input_size) are read through L1.
  template <bool PRED>
  __device__ __forceinline__ void apply_norm(const T* norm_weight, int64_t k, int64_t input_size,
                                             float (&sum_sq)[M_TILES]) {
#pragma unroll
    for (int i = 0; i < kXPerSlice; ++i) {
      const int64_t ki = k + x_offset(i);
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

  __device__ __forceinline__ void multiply(float (&acc)[M_TILES][4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int c = 0; c < Fmt::kXChunks; ++c) {
        const uint4 lo = Fmt::widen(w_lo[i], c);
        const uint4 hi = Fmt::widen(w_hi[i], c);
        const int j = i * Fmt::kXChunks + c;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma_m16n8k16<T>(acc[mt], lo.x, hi.x, lo.y, hi.y, x[mt][j].x, x[mt][j].y);
          mma_m16n8k16<T>(acc[mt], lo.z, hi.z, lo.w, hi.w, x[mt][j].z, x[mt][j].w);
        }
      }
    }
  }
};

// ---- The staged norm (SkinnyGemmArgs::stage_x, e4m3 weights with a normed input) ----
// The per-lane norm above costs each lane the math of all its x fragments: 8 chunks of 8 per
// slice for one token row, the same rows in every group of 4 lanes at one token. With a one-byte
// weight that math is as many instructions as the widening and the mmas together, and on an H200
// the fp8 normed forms ran at ~68% of copy while the bf16 LM head streamed at copy speed. Staged:
// the warp norms the slice's x rows once (lane l: chunk l of each real token row, 256 elements a
// row), writes them to its shared buffer, and the mmas read their fragments from there. The
// arithmetic per element is the per-lane norm's (x * g rounded to T, x^2 summed in fp32), so
// the products are the same bits; only the order of the sum of squares differs.
constexpr int kStagedChunks = 32;                   // 8-element chunks of one token row per slice
constexpr int kStagedRowPitch = kStagedChunks + 1;  // uint4 per staged row (+1: fewer conflicts)

// Norms chunk `lane` of the slice at k0 for tokens [0, num_tokens) into xs (rows of
// kStagedRowPitch uint4), adding each token's squares to sum_sq[token]. PRED: chunks at or past K
// read as zeros.
template <int TOKENS, bool PRED, typename T>
__device__ __forceinline__ void skinny_staged_norm_slice(uint4* xs, const T* input,
                                                         int64_t input_stride, int num_tokens,
                                                         const T* norm_weight, int64_t k0,
                                                         int64_t K, int lane,
                                                         float (&sum_sq)[TOKENS]) {
  const int64_t k = k0 + kSkinnyChunk * lane;
  const bool valid = !PRED || k < K;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const uint4 gv = valid ? __ldg(reinterpret_cast<const uint4*>(norm_weight + k)) : zero;
  const T* gp = reinterpret_cast<const T*>(&gv);
#pragma unroll
  for (int j = 0; j < TOKENS; ++j) {
    if (j >= num_tokens) break;  // uniform across the warp
    uint4 xv = valid ? load_input_chunk(input + j * input_stride + k) : zero;
    T* xp = reinterpret_cast<T*>(&xv);
#pragma unroll
    for (int e = 0; e < kSkinnyChunk; ++e) {
      const float f = to_float(xp[e]);
      sum_sq[j] = fmaf(f, f, sum_sq[j]);
      xp[e] = from_float<T>(f * to_float(gp[e]));
    }
    xs[j * kStagedRowPitch + lane] = xv;
  }
}

// The slice's mmas with x fragments from the staged rows: lane (g, t), tile mt reads token
// min(mt * 8 + g, num_tokens - 1)'s chunks 8 i + 2 t + c (the k of SkinnySlice's fragments).
template <int M_TILES, typename T>
__device__ __forceinline__ void skinny_staged_multiply(const uint4 (&w_lo)[4],
                                                       const uint4 (&w_hi)[4], const uint4* xs,
                                                       int num_tokens, int g, int t,
                                                       float (&acc)[M_TILES][4]) {
  using Fmt = SkinnyWeight<T, __nv_fp8_e4m3>;
  const uint4* rows[M_TILES];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
    rows[mt] = xs + min(mt * kSkinnyTileTokens + g, num_tokens - 1) * kStagedRowPitch + 2 * t;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int c = 0; c < Fmt::kXChunks; ++c) {
      const uint4 lo = Fmt::widen(w_lo[i], c);
      const uint4 hi = Fmt::widen(w_hi[i], c);
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        const uint4 x = rows[mt][8 * i + c];
        mma_m16n8k16<T>(acc[mt], lo.x, hi.x, lo.y, hi.y, x.x, x.y);
        mma_m16n8k16<T>(acc[mt], lo.z, hi.z, lo.w, hi.w, x.z, x.w);
      }
    }
  }
}

// One lane's 8 weight chunks of a slice (rows g and g + 8, k from this lane's first element).
template <bool PRED, bool L2_PREFETCH, typename W>
__device__ __forceinline__ void skinny_load_weights(uint4 (&w_lo)[4], uint4 (&w_hi)[4],
                                                    const W* w_lo_row, const W* w_hi_row, int64_t k,
                                                    int64_t K) {
  constexpr int kElems = 16 / static_cast<int>(sizeof(W));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t ki = k + 4 * kElems * i;
    const bool valid = !PRED || ki < K;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    w_lo[i] = valid ? load_weight_chunk<L2_PREFETCH>(w_lo_row + ki) : zero;
    w_hi[i] = valid ? load_weight_chunk<L2_PREFETCH>(w_hi_row + ki) : zero;
  }
}

// Grid: one block per 16 weight rows (kSiluMul: per 8 gate rows and their 8 up rows). Block:
// NUM_WARPS warps splitting K. M_TILES = ceil(num_tokens / 8). One slice is loaded per loop
// iteration; ptxas software-pipelines the loop (the next slice's 12-16 loads are in flight while
// this one is multiplied), so an explicit unroll of two slices only cost registers (measured
// slower on every shape).
// STAGED (SkinnyGemmArgs::stage_x, launched only for e4m3 weights with a normed input and one
// tile of tokens): the staged norm; its own instantiation, so the other forms' code is unchanged.
template <typename T, typename W, int M_TILES, int NUM_WARPS, bool L2_PREFETCH, bool NORM,
          SkinnyGemmEpilogue EPI, bool STAGED = false>
__global__ void __launch_bounds__(NUM_WARPS* kWarpSize, skinny_min_blocks<NUM_WARPS>())
    skinny_gemm_kernel(const SkinnyGemmArgs<T, W> args) {
  using Slice = SkinnySlice<M_TILES, T, W>;
  constexpr int kSliceK = Slice::Fmt::kSliceK;
  constexpr bool kScaled = !std::is_same_v<T, W>;  // a quantized weight: scale in the epilogue
  constexpr int kTokens = M_TILES * kSkinnyTileTokens;
  constexpr bool kPaired = EPI == SkinnyGemmEpilogue::kSiluMul;
  __shared__ float partial[NUM_WARPS][kTokens][kSkinnyRows];  // each warp's sums
  __shared__ float partial_sq[NUM_WARPS][kTokens];            // each warp's sums of x^2 (NORM)
  // The staged norm: e4m3 weights, a normed input, one tile of tokens (two tiles of 8 warps would
  // pass the 48 KiB of static shared memory).
  constexpr bool kStaged = STAGED && NORM && kScaled && M_TILES == 1;
  static_assert(kStaged || !STAGED, "the staged norm takes e4m3 weights, a norm and <= 8 tokens");
  __shared__ uint4 staged_x[kStaged ? NUM_WARPS : 1][kStaged ? kTokens * kStagedRowPitch : 1];

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
  const W* w_lo_row;
  const W* w_hi_row;
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

  const int num_slices = static_cast<int>((K + kSliceK - 1) / kSliceK);
  const int num_full_slices = static_cast<int>(K / kSliceK);
  const int64_t lane_k = Slice::Fmt::kElems * t;

  // The first slices' weight lines (two 128-byte lines per row per slice), asked of L2 before x
  // is ready: under PDL this overlaps the previous kernel's tail, and in any case it puts more
  // bytes in flight than the registers can hold while the pipeline fills.
  for (int j = 0; j < args.prefetch_slices; ++j) {
    const int64_t k = static_cast<int64_t>(warp + j * NUM_WARPS) * kSliceK + (64 / sizeof(W)) * t;
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
  if constexpr (kStaged) {
    {
      // Weights double-buffered by hand (the x fragments no longer live in registers across
      // the slice, so two slices of weights fit the register cap): the next slice's loads go
      // out before this slice's norm and mmas.
      uint4* xs = staged_x[warp];
      const int n = static_cast<int>(args.num_tokens);
      float tok_sq[kTokens] = {};
      auto stage_and_multiply = [&](const uint4(&wl)[4], const uint4(&wh)[4], int s, auto pred) {
        const int64_t k0 = static_cast<int64_t>(s) * kSliceK;
        __syncwarp();  // the previous slice's fragment reads are done
        skinny_staged_norm_slice<kTokens, decltype(pred)::value>(
            xs, args.input, args.input_stride, n, args.norm_weight, k0, K, lane, tok_sq);
        __syncwarp();
        skinny_staged_multiply<M_TILES, T>(wl, wh, xs, n, g, t, acc);
      };
      if (slice < num_full_slices) {
        uint4 cur_lo[4], cur_hi[4];
        skinny_load_weights<false, L2_PREFETCH>(cur_lo, cur_hi, w_lo_row, w_hi_row,
                                                static_cast<int64_t>(slice) * kSliceK + lane_k, K);
        while (true) {
          const int next = slice + NUM_WARPS;
          const bool more = next < num_full_slices;
          uint4 nxt_lo[4], nxt_hi[4];
          if (more) {
            skinny_load_weights<false, L2_PREFETCH>(nxt_lo, nxt_hi, w_lo_row, w_hi_row,
                                                    static_cast<int64_t>(next) * kSliceK + lane_k,
                                                    K);
          }
          stage_and_multiply(cur_lo, cur_hi, slice, std::false_type{});
          slice = next;
          if (!more) break;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            cur_lo[i] = nxt_lo[i];
            cur_hi[i] = nxt_hi[i];
          }
        }
      }
      if (slice < num_slices) {  // the K tail
        uint4 lo[4], hi[4];
        skinny_load_weights<true, L2_PREFETCH>(lo, hi, w_lo_row, w_hi_row,
                                               static_cast<int64_t>(slice) * kSliceK + lane_k, K);
        stage_and_multiply(lo, hi, slice, std::true_type{});
        slice = num_slices;
      }
      // Each token's squares over the warp's slices, summed across the lanes.
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        float v = tok_sq[j];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0) partial_sq[warp][j] = v;
      }
    }
  }
  if constexpr (kStaged) {
    // done above
  } else if constexpr (NORM && kScaled) {
    // e4m3: two slices (x doubled per slice) do not fit the register cap (the hand pipeline below
    // spilled 124-468 bytes): one slice per iteration, left to ptxas to pipeline.
    for (; slice < num_full_slices; slice += NUM_WARPS) {
      Slice s;
      const int64_t k = static_cast<int64_t>(slice) * kSliceK + lane_k;
      s.template load<false, L2_PREFETCH>(w_lo_row, w_hi_row, x_rows, k, K);
      s.template apply_norm<false>(args.norm_weight, k, K, sum_sq);
      s.multiply(acc);
    }
  } else if constexpr (NORM) {
    // Pipelined by hand: the next slice's loads are issued before this slice's norm math and
    // mmas (left to itself, ptxas kept one slice in flight here, against about two without the
    // norm).
    if (slice < num_full_slices) {
      Slice cur;
      cur.template load<false, L2_PREFETCH>(w_lo_row, w_hi_row, x_rows,
                                            static_cast<int64_t>(slice) * kSliceK + lane_k, K);
      while (true) {
        const int next = slice + NUM_WARPS;
        const bool more = next < num_full_slices;
        Slice nxt;
        if (more) {
          nxt.template load<false, L2_PREFETCH>(w_lo_row, w_hi_row, x_rows,
                                                static_cast<int64_t>(next) * kSliceK + lane_k, K);
        }
        cur.template apply_norm<false>(args.norm_weight,
                                       static_cast<int64_t>(slice) * kSliceK + lane_k, K, sum_sq);
        cur.multiply(acc);
        slice = next;
        if (!more) break;
        cur = nxt;
      }
    }
  } else {
    for (; slice < num_full_slices; slice += NUM_WARPS) {
      Slice s;
      s.template load<false, L2_PREFETCH>(w_lo_row, w_hi_row, x_rows,
                                          static_cast<int64_t>(slice) * kSliceK + lane_k, K);
      s.multiply(acc);
    }
  }
  if (!kStaged && slice < num_slices) {  // the partial slice of a K tail (K % 128 != 0)
    Slice s;
    const int64_t k = static_cast<int64_t>(slice) * kSliceK + lane_k;
    s.template load<true, L2_PREFETCH>(w_lo_row, w_hi_row, x_rows, k, K);
    if constexpr (NORM) s.template apply_norm<true>(args.norm_weight, k, K, sum_sq);
    s.multiply(acc);
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
    // Lanes (g, 0..3) hold the squares of token g's chunks of this warp's slices (staged: written
    // above).
#pragma unroll
    for (int mt = 0; mt < M_TILES && !kStaged; ++mt) {
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
    if constexpr (kScaled) sum *= args.weight_scale[args.weight_scale_per_row ? row : 0];
    if (args.bias != nullptr) sum += to_float(args.bias[row]);
    T* out = args.out + token * args.out_stride + row;
    if constexpr (kPaired) {
      float up = 0.f;
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) up += partial[w][token][r + 8];
      up *= scale;
      if constexpr (kScaled) up *= args.weight_scale[args.weight_scale_per_row ? half + row : 0];
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

template <typename T, int M_TILES, int NUM_WARPS, bool NORM, SkinnyGemmEpilogue EPI, typename W>
cudaError_t launch_skinny_gemm_variant(const SkinnyGemmArgs<T, W>& args, bool l2_prefetch, bool pdl,
                                       cudaStream_t stream) {
  constexpr int64_t kRowsPerBlock =
      EPI == SkinnyGemmEpilogue::kSiluMul ? kSkinnyRows / 2 : kSkinnyRows;
  const int64_t rows =
      EPI == SkinnyGemmEpilogue::kSiluMul ? args.output_size / 2 : args.output_size;
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  const dim3 block(NUM_WARPS * kWarpSize);
  if constexpr (NORM && !std::is_same_v<T, W> && M_TILES == 1) {
    if (args.stage_x) {
      if (l2_prefetch) {
        return launch_kernel(&skinny_gemm_kernel<T, W, M_TILES, NUM_WARPS, true, NORM, EPI, true>,
                             grid, block, 0, stream, pdl, args);
      }
      return launch_kernel(&skinny_gemm_kernel<T, W, M_TILES, NUM_WARPS, false, NORM, EPI, true>,
                           grid, block, 0, stream, pdl, args);
    }
  }
  if (l2_prefetch) {
    return launch_kernel(&skinny_gemm_kernel<T, W, M_TILES, NUM_WARPS, true, NORM, EPI>, grid,
                         block, 0, stream, pdl, args);
  }
  return launch_kernel(&skinny_gemm_kernel<T, W, M_TILES, NUM_WARPS, false, NORM, EPI>, grid, block,
                       0, stream, pdl, args);
}

// W: deduced from args (T itself, or e4m3 for skinny_gemm_fp8, which has no 16-warp form: its
// largest layers, 70B's gate_up, are 3584 blocks, below the 4096 where the 16-warp form pays).
template <typename T, int M_TILES, bool NORM, SkinnyGemmEpilogue EPI, typename W>
cudaError_t launch_skinny_gemm_tiles(const SkinnyGemmArgs<T, W>& args, int num_warps,
                                     bool l2_prefetch, bool pdl, cudaStream_t stream) {
  switch (num_warps) {
    case 4:
      return launch_skinny_gemm_variant<T, M_TILES, 4, NORM, EPI>(args, l2_prefetch, pdl, stream);
    case 8:
      return launch_skinny_gemm_variant<T, M_TILES, 8, NORM, EPI>(args, l2_prefetch, pdl, stream);
    case 16:
      if constexpr (std::is_same_v<T, W>) {
        return launch_skinny_gemm_variant<T, M_TILES, 16, NORM, EPI>(args, l2_prefetch, pdl,
                                                                     stream);
      }
      [[fallthrough]];
    default:
      PYORCH_INVALID("skinny_gemm: unsupported num_warps %d (4, 8%s)", num_warps,
                     std::is_same_v<T, W> ? " or 16" : "");
  }
}

}  // namespace pyorch::kernels
