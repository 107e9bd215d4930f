// Index math of pyorch's W4A16 tile layout (see pyorch/w4a16.h), shared by the CUDA kernels and the
// CPU kernels (cpp/cpu/w4a16.cpp), so both backends read and write the same bits. No CUDA or torch
// headers: the CPU build includes it too.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PYORCH_W4A16_HD __host__ __device__ __forceinline__
#else
#define PYORCH_W4A16_HD inline
#endif

namespace pyorch {

// Rows of k per block and columns of n per tile of the layout; size_k must be a multiple of
// kW4A16BlockK and size_n of kW4A16TileN.
constexpr int64_t kW4A16BlockK = 64;
constexpr int64_t kW4A16TileN = 16;
// int32 words per (n-tile, k-block): 32 lanes x 4.
constexpr int64_t kW4A16WordsPerBlock = 128;
// Columns one thread block of the CUDA GEMM covers (4 warps x one n-tile): the workspace needs
// ceil(size_n / kW4A16BlockN) ints.
constexpr int64_t kW4A16BlockN = 64;
// Up to this many rows of a the CUDA tensor-core kernel runs the whole product; above it the
// adapter (cpp/ops/w4a16.cpp) and the benchmark dequantize the weight in column chunks
// (w4a16_dequantize) and call cuBLAS.
constexpr int64_t kW4A16MaxMmaRows = 64;

// n-tiles per tile group: the tiles of one thread block of the CUDA GEMM (kW4A16BlockN columns).
constexpr int64_t kW4A16GroupTiles = kW4A16BlockN / kW4A16TileN;

// The index (in kW4A16WordsPerBlock words) of the block (n-tile nt, k-block kb). Tiles come in
// groups of kW4A16GroupTiles (the last group of a size_n that is not a multiple of 64 has fewer);
// a group's blocks are k-block-major, so k-block kb of all the group's tiles is one contiguous
// run (what the thread block that owns the group reads at one step).
PYORCH_W4A16_HD int64_t w4a16_block_index(int64_t nt, int64_t kb, int64_t kblocks, int64_t ntiles) {
  const int64_t first = nt / kW4A16GroupTiles * kW4A16GroupTiles;
  const int64_t tiles = ntiles - first < kW4A16GroupTiles ? ntiles - first : kW4A16GroupTiles;
  return first * kblocks + kb * tiles + (nt - first);
}

// The (n, k) of code p (bits 4p..4p+3) of word `word` (flat int32 index) of the w4 tiles of a
// [size_k, size_n] weight (the inverse of w4a16_block_index, then the lane's codes).
PYORCH_W4A16_HD void w4a16_code_coord(int64_t word, int p, int64_t size_k, int64_t size_n,
                                      int64_t* n, int64_t* k) {
  const int64_t kblocks = size_k / kW4A16BlockK;
  const int64_t ntiles = size_n / kW4A16TileN;
  const int kt = static_cast<int>(word % 4);
  const int lane = static_cast<int>((word / 4) % 32);
  const int64_t block = word / kW4A16WordsPerBlock;
  const int64_t first = block / (kW4A16GroupTiles * kblocks) * kW4A16GroupTiles;
  const int64_t tiles = ntiles - first < kW4A16GroupTiles ? ntiles - first : kW4A16GroupTiles;
  const int64_t rem = block - first * kblocks;
  const int64_t kb = rem / tiles;
  const int64_t nt = first + rem % tiles;
  const int g = lane / 4, t = lane % 4, r = p % 4, h = p / 4;
  *n = nt * kW4A16TileN + g + 8 * (r % 2);
  *k = kb * kW4A16BlockK + 16 * t + 4 * kt + h + 2 * (r / 2);
}

// AutoAWQ packs columns 8c .. 8c + 7 into word c in the order [0, 2, 4, 6, 1, 3, 5, 7]: column
// 8c + j sits in nibble awq_nibble_of_column(j).
PYORCH_W4A16_HD int awq_nibble_of_column(int j) { return (j % 2) * 4 + j / 2; }

}  // namespace pyorch
