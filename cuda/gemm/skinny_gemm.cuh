// Skinny GEMM for decode: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= 16.
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
// Programmatic dependent launch. Before waiting on the kernel that produced x
// (griddepcontrol.wait, a no-op without PDL) each warp asks L2 for its first weight slices, which
// depend on nothing; and the block lets the next kernel launch early
// (griddepcontrol.launch_dependents), so a chain of GEMMs overlaps one's tail with the next's
// first loads.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/reduce.cuh"

namespace pyorch::kernels {

constexpr int kSkinnyRows = 16;      // weight rows per block: the mma's M
constexpr int kSkinnyChunk = 8;      // elements of one 16-byte load
constexpr int kSkinnySliceK = 128;   // k per warp slice: 4 lanes x 4 chunks x 8 elements
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
  T* out;            // [num_tokens, output_size], row stride out_stride
  const T* input;    // [num_tokens, input_size], row stride input_stride
  const T* weight;   // [output_size, input_size], contiguous
  const T* bias;     // [output_size] or nullptr
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
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], uint32_t a0,
                                                            uint32_t a1, uint32_t a2, uint32_t a3,
                                                            uint32_t b0, uint32_t b1) {
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
  uint4 w_lo[4];           // row g, chunks i = 0..3
  uint4 w_hi[4];           // row g + 8
  uint4 x[M_TILES][4];     // token (tile * 8 + g), same chunks

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

// Grid: one block per 16 weight rows. Block: NUM_WARPS warps splitting K.
// M_TILES = ceil(num_tokens / 8). One slice is loaded per loop iteration; ptxas software-pipelines
// the loop (the next slice's 12-16 loads are in flight while this one is multiplied), so an
// explicit unroll of two slices only cost registers (measured slower on every shape).
template <typename T, int M_TILES, int NUM_WARPS, bool L2_PREFETCH>
__global__ void __launch_bounds__(NUM_WARPS * kWarpSize, skinny_min_blocks<NUM_WARPS>())
    skinny_gemm_kernel(const SkinnyGemmArgs<T> args) {
  constexpr int kTokens = M_TILES * kSkinnyTileTokens;
  __shared__ float partial[NUM_WARPS][kTokens][kSkinnyRows];  // each warp's sums

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  const int64_t K = args.input_size;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kSkinnyRows;
  const int64_t last_row = args.output_size - 1;
  const T* w_lo_row = args.weight + min(row0 + g, last_row) * K;
  const T* w_hi_row = args.weight + min(row0 + g + 8, last_row) * K;
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
  int slice = warp;
  for (; slice < num_full_slices; slice += NUM_WARPS) {
    SkinnySlice<M_TILES> s;
    s.template load<false, L2_PREFETCH>(w_lo_row, w_hi_row, x_rows,
                                        static_cast<int64_t>(slice) * kSkinnySliceK + lane_k, K);
    s.template multiply<T>(acc);
  }
  if (slice < num_slices) {  // the partial slice of a K tail (K % 128 != 0)
    SkinnySlice<M_TILES> s;
    s.template load<true, L2_PREFETCH>(w_lo_row, w_hi_row, x_rows,
                                       static_cast<int64_t>(slice) * kSkinnySliceK + lane_k, K);
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
  __syncthreads();
  // One thread per output, consecutive threads on consecutive columns; warps summed in order.
  const int num_outputs = static_cast<int>(args.num_tokens) * kSkinnyRows;
  for (int idx = threadIdx.x; idx < num_outputs; idx += NUM_WARPS * kWarpSize) {
    const int token = idx / kSkinnyRows;
    const int r = idx % kSkinnyRows;
    const int64_t row = row0 + r;
    if (row > last_row) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) sum += partial[w][token][r];
    if (args.bias != nullptr) sum += to_float(args.bias[row]);
    args.out[token * args.out_stride + row] = from_float<T>(sum);
  }
}

template <typename T, int M_TILES, int NUM_WARPS>
cudaError_t launch_skinny_gemm_variant(const SkinnyGemmArgs<T>& args, bool l2_prefetch, bool pdl,
                                       cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((args.output_size + kSkinnyRows - 1) / kSkinnyRows));
  const dim3 block(NUM_WARPS * kWarpSize);
  if (l2_prefetch) {
    return launch_kernel(&skinny_gemm_kernel<T, M_TILES, NUM_WARPS, true>, grid, block, 0, stream,
                         pdl, args);
  }
  return launch_kernel(&skinny_gemm_kernel<T, M_TILES, NUM_WARPS, false>, grid, block, 0, stream,
                       pdl, args);
}

template <typename T, int M_TILES>
cudaError_t launch_skinny_gemm_tiles(const SkinnyGemmArgs<T>& args, int num_warps,
                                     bool l2_prefetch, bool pdl, cudaStream_t stream) {
  switch (num_warps) {
    case 4: return launch_skinny_gemm_variant<T, M_TILES, 4>(args, l2_prefetch, pdl, stream);
    case 8: return launch_skinny_gemm_variant<T, M_TILES, 8>(args, l2_prefetch, pdl, stream);
    case 16: return launch_skinny_gemm_variant<T, M_TILES, 16>(args, l2_prefetch, pdl, stream);
    default: PYORCH_INVALID("skinny_gemm: unsupported num_warps %d (4, 8 or 16)", num_warps);
  }
}

}  // namespace pyorch::kernels
