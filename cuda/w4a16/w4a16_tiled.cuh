// The W4A16 GEMM of batches: out [m, n] = a [m, k] @ dequant(W) [k, n] for any m, with W in the
// w4 tile layout (pyorch/w4a16.h). The decode kernels (w4a16_stream.cuh, w4a16_gemm.cuh) give
// each warp one 16-column n-tile and have it load the activations itself, so above 16 rows every
// warp re-reads the same activations (8 KiB per 64-row k-block at m = 64 against 512 bytes of
// codes) and the kernel is bound by L1/L2, not by the weight stream. Here a thread block of 8
// warps stages one k-block of its kW4TiledBlockN = 128 columns' codes and of its block of rows'
// activations in shared memory (a kW4TiledStages-deep cp.async ring), and each warp covers 2
// n-tiles x M_TILES 8-row m-tiles: a dequantized weight fragment serves M_TILES mmas and an
// activation fragment 2. Grid: (row blocks, column blocks, k-splits), the row block fastest so
// that the thread blocks sharing a column block's codes run together and read them from L2. When
// the tiles fill too few SMs, the k range is split as in w4a16_gemm.cuh (fp32 partials, the last
// thread block of a tile sums them in split order: deterministic).
#pragma once

#include <cstdint>

#include "attention/paged_attention_utils.cuh"  // cp.async
#include "common/check.cuh"
#include "w4a16/w4a16_gemm.cuh"

namespace pyorch::kernels {

constexpr int kW4TiledWarpsN = 4;  // warps along n
constexpr int kW4TiledWarpsM = 2;  // warps along m
constexpr int kW4TiledThreads = kW4TiledWarpsN * kW4TiledWarpsM * 32;
constexpr int kW4TiledTilesN = 2;  // 16-column n-tiles per warp
constexpr int kW4TiledBlockN = kW4TiledWarpsN * kW4TiledTilesN * static_cast<int>(kW4A16TileN);
constexpr int kW4TiledStages = 4;
// The codes of one k-block of a thread block's n-tiles: one 16-byte copy per thread.
static_assert(kW4TiledBlockN / kW4A16TileN * 32 == kW4TiledThreads, "one code copy per thread");

template <int M_TILES>
struct W4TiledShape {
  static constexpr int kBlockM = kW4TiledWarpsM * M_TILES * 8;
  static constexpr int kCodesBytes = kW4TiledBlockN / kW4A16TileN * 512;
  // One 64-value row (128 bytes, 8 chunks of 16) per row of the block; chunk c of row r sits at
  // chunk c ^ (r % 8), so that the 8 lanes of a quarter warp (rows g, g + 1; chunks 2t or
  // 2t + 1) hit 8 different 16-byte bank groups.
  static constexpr int kActsBytes = kBlockM * 128;
  static constexpr int kStageBytes = kCodesBytes + kActsBytes;
  static constexpr int kSmemBytes = kW4TiledStages * kStageBytes;
};

// Copies k-block kb's codes and activations into one stage of the ring (rows past m and n-tiles
// past n: zeros).
template <typename T, int M_TILES>
__device__ __forceinline__ void w4_tiled_load_stage(const W4A16GemmArgs& p, uint8_t* stage,
                                                    int64_t nt0, int m0, int kb, int kblocks) {
  using Shape = W4TiledShape<M_TILES>;
  {
    const int j = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t nt = nt0 + j;
    const bool valid = nt < p.n / kW4A16TileN;
    const uint4* src = p.b_q + ((valid ? nt : 0) * kblocks + kb) * 32 + lane;
    attn::cp_async_16(reinterpret_cast<uint4*>(stage) + threadIdx.x, src, valid);
  }
  const T* a = static_cast<const T*>(p.a);
  uint4* acts = reinterpret_cast<uint4*>(stage + Shape::kCodesBytes);
  static_assert(Shape::kBlockM * 8 % kW4TiledThreads == 0, "whole copies per thread");
#pragma unroll
  for (int it = 0; it < Shape::kBlockM * 8 / kW4TiledThreads; ++it) {
    const int c = threadIdx.x + it * kW4TiledThreads;
    const int r = c / 8, chunk = c % 8, row = m0 + r;
    const bool valid = row < p.m;
    const T* src =
        a + (valid ? row : 0) * p.a_stride + static_cast<int64_t>(kb) * kW4A16BlockK + chunk * 8;
    attn::cp_async_16(acts + r * 8 + (chunk ^ (r % 8)), src, valid);
  }
}

// grid (ceil(m / kBlockM), ceil(n / kW4TiledBlockN), num_splits), kW4TiledThreads threads,
// W4TiledShape<M_TILES>::kSmemBytes of dynamic shared memory. p.counters holds one counter per
// (row block, column block) tile when num_splits > 1.
template <typename T, int M_TILES, bool HAS_ZEROS>
__global__ void __launch_bounds__(kW4TiledThreads, 2) w4a16_tiled_kernel(const W4A16GemmArgs p) {
  using Shape = W4TiledShape<M_TILES>;
  extern __shared__ __align__(128) uint8_t w4_smem[];  // one declaration with the stream kernels
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int wn = warp % kW4TiledWarpsN, wm = warp / kW4TiledWarpsN;
  const int m0 = blockIdx.x * Shape::kBlockM;
  const int64_t nt0 = static_cast<int64_t>(blockIdx.y) * (kW4TiledBlockN / kW4A16TileN);
  const int64_t n_tiles = p.n / kW4A16TileN;
  const int kblocks = p.k / static_cast<int>(kW4A16BlockK);
  const int kb_begin = blockIdx.z * p.blocks_per_split;
  const int steps = min(kb_begin + p.blocks_per_split, kblocks) - kb_begin;
  // This warp's first row and n-tile; warps with no row or no column left skip the products.
  const int warp_m0 = m0 + wm * M_TILES * 8;
  const int64_t warp_nt = nt0 + wn * kW4TiledTilesN;
  const bool active = warp_m0 < p.m && warp_nt < n_tiles;

  float acc[kW4TiledTilesN][M_TILES][4] = {};
#pragma unroll
  for (int s = 0; s < kW4TiledStages - 1; ++s) {
    if (s < steps) {
      w4_tiled_load_stage<T, M_TILES>(p, w4_smem + s * Shape::kStageBytes, nt0, m0, kb_begin + s,
                                      kblocks);
    }
    attn::cp_async_commit();
  }
  // The group (scales, zero points) of the lane's n-tiles, one k-block ahead of its use.
  W4Stage group[kW4TiledTilesN];
  if (active) {
#pragma unroll
    for (int j = 0; j < kW4TiledTilesN; ++j) {
      w4_load_group<T, HAS_ZEROS>(p, min(warp_nt + j, n_tiles - 1), kb_begin, lane, &group[j]);
    }
  }
  for (int i = 0; i < steps; ++i) {
    attn::cp_async_wait<kW4TiledStages - 2>();
    __syncthreads();  // stage i has landed for all; stage i - 1 is free to refill
    const int ahead = i + kW4TiledStages - 1;
    if (ahead < steps) {
      w4_tiled_load_stage<T, M_TILES>(p, w4_smem + (ahead % kW4TiledStages) * Shape::kStageBytes,
                                      nt0, m0, kb_begin + ahead, kblocks);
    }
    attn::cp_async_commit();
    if (!active) continue;
    const uint8_t* stage = w4_smem + (i % kW4TiledStages) * Shape::kStageBytes;
    const uint4* codes = reinterpret_cast<const uint4*>(stage);
    const uint4* acts = reinterpret_cast<const uint4*>(stage + Shape::kCodesBytes);
    uint32_t frag[kW4TiledTilesN][4][4];
#pragma unroll
    for (int j = 0; j < kW4TiledTilesN; ++j) {
      group[j].codes = codes[(wn * kW4TiledTilesN + j) * 32 + lane];
      w4_dequant_frags<T, HAS_ZEROS>(group[j], frag[j]);
    }
    if (i + 1 < steps) {
#pragma unroll
      for (int j = 0; j < kW4TiledTilesN; ++j) {
        w4_load_group<T, HAS_ZEROS>(p, min(warp_nt + j, n_tiles - 1), kb_begin + i + 1, lane,
                                    &group[j]);
      }
    }
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      if (warp_m0 + mt * 8 >= p.m) break;           // warp-uniform
      const int r = wm * M_TILES * 8 + mt * 8 + g;  // r % 8 == g
      const uint4 b0 = acts[r * 8 + ((2 * t) ^ g)];
      const uint4 b1 = acts[r * 8 + ((2 * t + 1) ^ g)];
#pragma unroll
      for (int j = 0; j < kW4TiledTilesN; ++j) w4_mma_block<T>(acc[j][mt], frag[j], b0, b1);
    }
  }
  attn::cp_async_wait<0>();

  // acc[j][mt][e]: row warp_m0 + 8 mt + 2 t + e % 2, column 16 (warp_nt + j) + g + 8 (e / 2); each
  // in-range value goes to store(row, col, value).
  auto for_each_output = [&](auto store) {
#pragma unroll
    for (int j = 0; j < kW4TiledTilesN; ++j) {
      if (warp_nt + j >= n_tiles) break;
      const int64_t col = (warp_nt + j) * kW4A16TileN + g;
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = warp_m0 + mt * 8 + 2 * t + e % 2;
          if (row < p.m) store(row, col + 8 * (e / 2), acc[j][mt][e]);
        }
      }
    }
  };
  T* out = static_cast<T*>(p.out);
  if (p.num_splits == 1) {
    if (active) {
      for_each_output(
          [&](int row, int64_t col, float v) { out[row * p.out_stride + col] = from_float<T>(v); });
    }
    return;
  }
  if (active) {
    float* part = p.partials + static_cast<int64_t>(blockIdx.z) * p.m * p.n;
    for_each_output(
        [&](int row, int64_t col, float v) { part[static_cast<int64_t>(row) * p.n + col] = v; });
  }
  // The tile's last thread block to arrive sums the splits' partials in split order.
  __shared__ int is_last;
  const int counter = blockIdx.y * gridDim.x + blockIdx.x;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(&p.counters[counter], 1) == p.num_splits - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int64_t n0 = nt0 * kW4A16TileN;
  w4_sum_partials<T, 4>(p, m0, min(Shape::kBlockM, p.m - m0), n0,
                        static_cast<int>(min(static_cast<int64_t>(kW4TiledBlockN), p.n - n0)));
  if (threadIdx.x == 0) p.counters[counter] = 0;
}

// The m-tiles per warp the launcher uses for m rows: 32-row warps (a 64-row block) up to 64 rows,
// 64-row warps (128) above, where each weight fragment then feeds 8 mmas.
inline int w4_tiled_m_tiles(int64_t m) { return m <= 64 ? 4 : 8; }
inline int64_t w4_tiled_block_m(int64_t m) { return kW4TiledWarpsM * w4_tiled_m_tiles(m) * 8; }

template <typename T>
cudaError_t launch_w4a16_tiled(const W4A16GemmArgs& p, bool has_zeros, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.m + w4_tiled_block_m(p.m) - 1) / w4_tiled_block_m(p.m)),
                  static_cast<unsigned>((p.n + kW4TiledBlockN - 1) / kW4TiledBlockN),
                  static_cast<unsigned>(p.num_splits));
  auto launch = [&](auto m_tiles, auto zeros) -> cudaError_t {
    constexpr int kMTiles = decltype(m_tiles)::value;
    constexpr int kSmem = W4TiledShape<kMTiles>::kSmemBytes;
    auto* kernel = w4a16_tiled_kernel<T, kMTiles, decltype(zeros)::value>;
    // Above 48 KiB of dynamic shared memory needs the opt-in (per device; cheap to repeat).
    PYORCH_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    kernel<<<grid, kW4TiledThreads, kSmem, stream>>>(p);
    return cudaGetLastError();
  };
  auto with_tiles = [&](auto zeros) {
    return w4_tiled_m_tiles(p.m) == 4 ? launch(std::integral_constant<int, 4>{}, zeros)
                                      : launch(std::integral_constant<int, 8>{}, zeros);
  };
  return has_zeros ? with_tiles(std::true_type{}) : with_tiles(std::false_type{});
}

}  // namespace pyorch::kernels
