// gguf_mul_mat_vec: few tokens, each weight row read once. One warp per weight row streams it in
// tiles of whole blocks with 16-byte cp.async copies into a warp-private ring of shared-memory
// stages (blocks are 18 to 210 bytes, so no lane's block is 16-byte aligned by itself; the ring
// keeps `num_stages - 1` tiles in flight without holding them in registers); each lane then
// decodes two sub-blocks of the tile and takes dp4a dot products with the tokens' q8_1 blocks.
// Launched with PDL where enabled: the first tiles' copies are issued before waiting for the q8_1
// kernel that precedes it.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "gguf/gguf_blocks.cuh"
#include "gguf/gguf_q8_1.cuh"

namespace pyorch::kernels::gguf {

constexpr int kMmvqWarps = 4;  // weight rows per thread block

// A warp's tile: SUBS_PER_LANE sub-blocks per lane (2: 64 per tile, 2048 weights), a whole
// number of blocks and of 16-byte chunks.
template <int TYPE, int SUBS_PER_LANE>
struct MmvqTile {
  using Traits = BlockTraits<TYPE>;
  static constexpr int kSubsPerBlock = Traits::kBlockSize / kSubSize;
  static constexpr int kSubsPerLane = SUBS_PER_LANE;
  static constexpr int kBlocks = kWarpSize * kSubsPerLane / kSubsPerBlock;
  static constexpr int kBytes = kBlocks * Traits::kBlockBytes;
  static constexpr int kChunks = kBytes / 16;
  // A stage holds one chunk more than a tile: a row need not start on 16 bytes, so its tiles are
  // copied from the 16-byte boundary below and read `misalign` bytes in.
  static constexpr int kStageChunks = kChunks + 1;
  static_assert(kBytes % 16 == 0, "a tile must be whole 16-byte chunks");
};

// Dynamic shared memory of one thread block: kMmvqWarps rings of num_stages stages.
template <int TYPE, int SUBS_PER_LANE>
constexpr size_t mmvq_smem_bytes(int num_stages) {
  return size_t(kMmvqWarps) * num_stages * MmvqTile<TYPE, SUBS_PER_LANE>::kStageChunks * 16;
}

// 16 bytes global -> shared without passing through registers; L2_256: ask L2 to fetch the
// whole 256-byte segment (the next lanes' chunks) with the first request.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool l2_256) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (l2_256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem)
                 : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
  }
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most `pending` (0..3) of this thread's committed groups are in flight.
__device__ __forceinline__ void cp_async_wait(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
  }
}

// Stores v as out's dtype (fp32, fp16 or bf16) at out[idx]; the dtype is uniform per launch.
__device__ __forceinline__ void store_as(void* out, DType dtype, int64_t idx, float v) {
  switch (dtype) {
    case DType::kFloat16: static_cast<__half*>(out)[idx] = __float2half_rn(v); break;
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(out)[idx] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(out)[idx] = v; break;
  }
}

// The 16 bytes at p (16-byte aligned) of which only those inside the weight [lo, hi) are read
// (zeros for the rest), with 2-byte loads (blocks are an even number of bytes): the chunks at the
// tensor's two ends, which a 16-byte copy would overrun. Out of line: it runs only there.
__device__ __noinline__ uint4 load_chunk_edge(const uint8_t* p, const uint8_t* lo,
                                              const uint8_t* hi) {
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint8_t* q = p + 2 * i;
    if (q >= lo && q + 2 <= hi) {
      w[i / 2] |= uint32_t(__ldg(reinterpret_cast<const uint16_t*>(q))) << (16 * (i % 2));
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The dot product of one decoded sub-block with one token's q8_1 block. PER32: w's two halves
// share their scale and bias (kScalePer32).
//   xq: [32] int8 (16-byte aligned)
template <bool PER32>
__device__ __forceinline__ float sub_dot_q8_1(const Sub32& w, const int8_t* __restrict__ xq,
                                              const Q81Scale& ds) {
  const int4 x0 = *reinterpret_cast<const int4*>(xq);
  const int4 x1 = *reinterpret_cast<const int4*>(xq + 16);
  int lo = __dp4a(int(w.q[0]), x0.x, 0);
  lo = __dp4a(int(w.q[1]), x0.y, lo);
  lo = __dp4a(int(w.q[2]), x0.z, lo);
  lo = __dp4a(int(w.q[3]), x0.w, lo);
  int hi = __dp4a(int(w.q[4]), x1.x, 0);
  hi = __dp4a(int(w.q[5]), x1.y, hi);
  hi = __dp4a(int(w.q[6]), x1.z, hi);
  hi = __dp4a(int(w.q[7]), x1.w, hi);
  if constexpr (PER32) return w.scale[0] * ds.d * float(lo + hi) + w.bias[0] * (ds.s[0] + ds.s[1]);
  return w.scale[0] * ds.d * float(lo) + w.bias[0] * ds.s[0] + w.scale[1] * ds.d * float(hi) +
         w.bias[1] * ds.s[1];
}

// out[t, row] for NUM_TOKENS tokens (the launcher passes num_tokens <= NUM_TOKENS; the missing
// ones repeat the last token and are not stored).
//   out:    [num_tokens, output_size] (row stride out_stride), of out_dtype
//   weight: [output_size, num_blocks blocks] (row stride weight_row_stride_bytes)
//   xq:     [num_tokens, input_size] int8,  xds: [num_tokens, input_size / 32]
template <int TYPE, int NUM_TOKENS, int SUBS_PER_LANE>
__global__ void __launch_bounds__(kMmvqWarps* kWarpSize)
    mul_mat_vec_kernel(void* __restrict__ out, DType out_dtype, const uint8_t* __restrict__ weight,
                       const int8_t* __restrict__ xq, const Q81Scale* __restrict__ xds,
                       int num_tokens, int64_t output_size, int64_t input_size,
                       int64_t weight_row_stride_bytes, int64_t out_stride, int num_stages,
                       bool l2_256) {
  using Traits = BlockTraits<TYPE>;
  using Tile = MmvqTile<TYPE, SUBS_PER_LANE>;
  extern __shared__ uint4 mmvq_smem[];  // [kMmvqWarps][num_stages][kStageChunks]
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = int64_t(blockIdx.x) * kMmvqWarps + warp;
  if (row >= output_size) return;  // whole warps; no block-wide barrier below
  const int64_t num_blocks = input_size / Traits::kBlockSize;
  const int64_t row_bytes = num_blocks * Traits::kBlockBytes;
  const int64_t num_subs = input_size / kSubSize;
  const int num_tiles = static_cast<int>((num_blocks + Tile::kBlocks - 1) / Tile::kBlocks);
  const uint8_t* row_ptr = weight + row * weight_row_stride_bytes;
  const int misalign = static_cast<int>(reinterpret_cast<uintptr_t>(row_ptr) % 16);
  const uint8_t* aligned_row = row_ptr - misalign;
  const uint8_t* weight_end = weight + (output_size - 1) * weight_row_stride_bytes + row_bytes;
  const int num_chunks = Tile::kChunks + (misalign != 0);  // uniform across the warp
  uint4* ring = mmvq_smem + int64_t(warp) * num_stages * Tile::kStageChunks;

  // Copies tile t of the row into its stage. Chunks at the tensor's ends are loaded and stored
  // (visible after the __syncwarp that precedes their use, like the copies).
  auto issue_tile = [&](int t) {
    uint4* stage = ring + (t % num_stages) * Tile::kStageChunks;
    const uint8_t* src = aligned_row + int64_t(t) * Tile::kBytes;
    for (int c = lane; c < num_chunks; c += kWarpSize) {
      const uint8_t* p = src + 16 * c;
      if (p >= weight && p + 16 <= weight_end) {
        cp_async_16(stage + c, p, l2_256);
      } else {
        stage[c] = load_chunk_edge(p, weight, weight_end);
      }
    }
  };
  float acc[NUM_TOKENS];
#pragma unroll
  for (int t = 0; t < NUM_TOKENS; ++t) acc[t] = 0.f;

  // Under PDL this runs while the q8_1 kernel before it finishes: weights first, then wait for x.
  for (int t = 0; t < num_stages - 1; ++t) {
    if (t < num_tiles) issue_tile(t);
    cp_async_commit();  // one group per tile slot, empty or not, so the count below holds
  }
  pdl_wait();
  for (int t = 0; t < num_tiles; ++t) {
    // The stage refilled here was last read in iteration t - 1, which ended with __syncwarp.
    if (t + num_stages - 1 < num_tiles) issue_tile(t + num_stages - 1);
    cp_async_commit();
    cp_async_wait(num_stages - 1);  // tile t's copies (this lane's) have landed
    __syncwarp();                   // ... and every lane's
    // Where the decoders read: misalign keeps 4-byte fields 4-byte aligned (the API checks rows
    // of such types are).
    const uint8_t* tile_bytes =
        reinterpret_cast<const uint8_t*>(ring + (t % num_stages) * Tile::kStageChunks) + misalign;
    const int64_t block0 = int64_t(t) * Tile::kBlocks;
    // With several tokens, one sub-block at a time: unrolled, the decoded sub-blocks and the
    // tokens' accumulators outgrew the registers (up to 188 at 8 tokens).
    constexpr int kUnrollSubs = NUM_TOKENS > 2 ? 1 : Tile::kSubsPerLane;
#pragma unroll kUnrollSubs
    for (int s = 0; s < Tile::kSubsPerLane; ++s) {
      const int u = lane + s * kWarpSize;  // sub-block within the tile
      const int b = u / Tile::kSubsPerBlock;
      const int64_t sub_idx = (block0 + b) * Tile::kSubsPerBlock + u % Tile::kSubsPerBlock;
      if (sub_idx < num_subs) {
        Sub32 w;
        Traits::unpack(tile_bytes + b * Traits::kBlockBytes, u % Tile::kSubsPerBlock, w);
#pragma unroll
        for (int t2 = 0; t2 < NUM_TOKENS; ++t2) {
          const int tok = t2 < num_tokens ? t2 : num_tokens - 1;
          acc[t2] += sub_dot_q8_1<kScalePer32<TYPE>>(w, xq + tok * input_size + sub_idx * kSubSize,
                                                     xds[tok * (input_size / kSubSize) + sub_idx]);
        }
      }
    }
    __syncwarp();  // the stage is refilled by a later iteration
  }
  pdl_launch_dependents();
#pragma unroll
  for (int t = 0; t < NUM_TOKENS; ++t) {
    const float v = warp_reduce_sum(acc[t]);
    if (lane == 0 && t < num_tokens) store_as(out, out_dtype, t * out_stride + row, v);
  }
}

// subs_per_lane: 2 or 4 (the tile size); num_stages: 2..4 (tiles in flight + 1); l2_256: the
// copies' L2::256B prefetch hint; pdl: launch with programmatic dependent launch.
template <int TYPE, int NUM_TOKENS>
cudaError_t launch_mul_mat_vec(void* out, DType out_dtype, const uint8_t* weight, const int8_t* xq,
                               const Q81Scale* xds, int num_tokens, int64_t output_size,
                               int64_t input_size, int64_t weight_row_stride_bytes,
                               int64_t out_stride, int subs_per_lane, int num_stages, bool l2_256,
                               bool pdl, cudaStream_t stream) {
  const size_t smem = subs_per_lane == 4 ? mmvq_smem_bytes<TYPE, 4>(num_stages)
                                         : mmvq_smem_bytes<TYPE, 2>(num_stages);
  if (smem > 48 * 1024) {
    PYORCH_INVALID(
        "gguf_mul_mat_vec: %d stages of %d sub-blocks per lane take %zu bytes of shared "
        "memory (at most 49152)",
        num_stages, subs_per_lane, smem);
  }
  const int64_t grid = (output_size + kMmvqWarps - 1) / kMmvqWarps;
  auto* kernel = subs_per_lane == 4 ? mul_mat_vec_kernel<TYPE, NUM_TOKENS, 4>
                                    : mul_mat_vec_kernel<TYPE, NUM_TOKENS, 2>;
  return launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(kMmvqWarps * kWarpSize),
                       smem, stream, pdl, out, out_dtype, weight, xq, xds, num_tokens, output_size,
                       input_size, weight_row_stride_bytes, out_stride, num_stages, l2_256);
}

}  // namespace pyorch::kernels::gguf
