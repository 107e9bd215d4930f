// What the MoE benchmark binaries share (bench_moe, bench_moe_decode): the model shapes and
// device buffers of deterministic pseudo-random weights.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include "common/bench_util.h"

namespace pyorch::bench {

struct MoeShape {
  std::string name;
  int64_t experts, top_k, hidden, inter;
};

// Per layer, gate_up then down: Mixtral-8x7B, Qwen3-30B-A3B and Qwen3-235B-A22B.
inline const std::vector<MoeShape> kMoeShapes = {{"mixtral", 8, 2, 4096, 14336},
                                                 {"qwen3_moe", 128, 8, 2048, 768},
                                                 {"qwen3_235b", 128, 8, 4096, 1536}};

// bf16 values uniform in [-scale / 2, scale / 2), or (fp8) e4m3 bytes of magnitude < 448.
__global__ void moe_bench_fill_kernel(uint16_t* data, size_t n, uint64_t seed, bool fp8,
                                      float scale) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    uint64_t z = (i + seed * 0x632be59bd9b4e019ull) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
    const float u = static_cast<float>((z >> 40) & 0xffff) / 65536.f - 0.5f;
    if (fp8) {
      reinterpret_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(z >> 48) & 0x77;  // |x| < 448
    } else {
      data[i] = __bfloat16_as_ushort(__float2bfloat16(u * scale));
    }
  }
}

// A device buffer of `elems` elements of elem_bytes (2: bf16, 1: e4m3) filled as above.
inline void* moe_bench_random(size_t elems, size_t elem_bytes, uint64_t seed, float scale = 0.1f) {
  void* p = nullptr;
  BENCH_CHECK(cudaMalloc(&p, elems * elem_bytes));
  moe_bench_fill_kernel<<<1024, 256>>>(static_cast<uint16_t*>(p), elems, seed, elem_bytes == 1,
                                       scale);
  BENCH_CHECK(cudaGetLastError());
  return p;
}

}  // namespace pyorch::bench
