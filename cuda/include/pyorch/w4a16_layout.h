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
// Rows the CUDA register-staged kernel (cuda/w4a16/w4a16_gemm.cuh) handles at most; the tiled
// kernel (w4a16_tiled.cuh) takes any m.
constexpr int64_t kW4A16RegistersMaxRows = 64;

// The (n, k) of code p (bits 4p..4p+3) of word `word` (flat int32 index) of the w4 tiles of a
// [size_k, size_n] weight.
PYORCH_W4A16_HD void w4a16_code_coord(int64_t word, int p, int64_t size_k, int64_t* n, int64_t* k) {
  const int64_t kblocks = size_k / kW4A16BlockK;
  const int kt = static_cast<int>(word % 4);
  const int lane = static_cast<int>((word / 4) % 32);
  const int64_t block = word / kW4A16WordsPerBlock;
  const int64_t kb = block % kblocks;
  const int64_t nt = block / kblocks;
  const int g = lane / 4, t = lane % 4, r = p % 4, h = p / 4;
  *n = nt * kW4A16TileN + g + 8 * (r % 2);
  *k = kb * kW4A16BlockK + 16 * t + 4 * kt + h + 2 * (r / 2);
}

// AutoAWQ packs columns 8c .. 8c + 7 into word c in the order [0, 2, 4, 6, 1, 3, 5, 7]: column
// 8c + j sits in nibble awq_nibble_of_column(j).
PYORCH_W4A16_HD int awq_nibble_of_column(int j) { return (j % 2) * 4 + j / 2; }

}  // namespace pyorch
