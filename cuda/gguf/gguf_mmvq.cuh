// gguf_mul_mat_vec: few tokens, each weight row read once. One warp per weight row streams it in
// tiles of whole blocks with 16-byte cp.async copies into a warp-private ring of shared-memory
// stages (blocks are 18 to 210 bytes, so no lane's block is 16-byte aligned by itself; the ring
// keeps `num_stages - 1` tiles in flight without holding them in registers); each lane then
// decodes two (or four) sub-blocks of the tile and takes dp4a dot products with the tokens' q8_1
// blocks.
// Launched with PDL where enabled: the first tiles' copies are issued before waiting for the
// kernel that writes x.
//
// x reaches the dot products as q8_1 blocks, from one of two places:
// - the workspace, written by quantize_q8_1_kernel (launched before this kernel), read through L1;
// - FUSE_X (one token): the thread block quantizes x itself into shared memory after its first
//   copies are issued, the same arithmetic, so the result has the same bits. This saves a launch
//   and a kernel boundary per product, and the dot products read x from shared memory (in the
//   workspace form their L1/L2 loads were the longest stall). Each block repeats the
//   quantization (input_size / 32 blocks of 32 values), so blocks carry up to kMmvqMaxWarps rows
//   and the grid stops at the resident blocks: a warp then takes rows row0, row0 + gridDim.x *
//   warps, ..., its copies running on from one row into the next.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "gguf/gguf_blocks.cuh"
#include "gguf/gguf_q8_1.cuh"

namespace pyorch::kernels::gguf {

constexpr int kMmvqWarps = 4;     // weight rows per thread block (the default)
constexpr int kMmvqMaxWarps = 8;  // ... at most (blockDim.x / 32 is the count)

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

// FUSE_X's q8_1 copy of x in shared memory: [input_size] int8 (padded to 16 bytes), then
// [input_size / 32] Q81Scale.
constexpr size_t mmvq_x_smem_bytes(int64_t input_size) {
  return size_t((input_size + 15) / 16 * 16) + size_t(input_size / 32) * sizeof(Q81Scale);
}

// Dynamic shared memory of one thread block: `warps` rings of num_stages stages, then (FUSE_X)
// the q8_1 copy of x.
template <int TYPE, int SUBS_PER_LANE>
constexpr size_t mmvq_smem_bytes(int warps, int num_stages, bool fuse_x, int64_t input_size) {
  return size_t(warps) * num_stages * MmvqTile<TYPE, SUBS_PER_LANE>::kStageChunks * 16 +
         (fuse_x ? mmvq_x_smem_bytes(input_size) : 0);
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
// (Compares, not a switch: nvcc made the switch a jump table, ~10 instructions per tile.)
__device__ __forceinline__ void cp_async_wait(int pending) {
  if (pending <= 0) {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  } else if (pending == 1) {
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  } else if (pending == 2) {
    asm volatile("cp.async.wait_group 2;\n" ::: "memory");
  } else {
    asm volatile("cp.async.wait_group 3;\n" ::: "memory");
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

// Quantizes x (one token, input_size values of dtype, 16-byte aligned) into the block's q8_1
// copy: one 32-value block per thread at a time.
__device__ __forceinline__ void quantize_x_to_smem(const void* __restrict__ x, DType dtype,
                                                   int64_t input_size, int8_t* xq, Q81Scale* xds) {
  const int64_t num_subs = input_size / kSubSize;
  for (int64_t b = threadIdx.x; b < num_subs; b += blockDim.x) {
    switch (dtype) {
      case DType::kFloat16:
        quantize_q8_1_block(static_cast<const __half*>(x) + b * kSubSize, xq + b * kSubSize,
                            xds + b);
        break;
      case DType::kBFloat16:
        quantize_q8_1_block(static_cast<const __nv_bfloat16*>(x) + b * kSubSize, xq + b * kSubSize,
                            xds + b);
        break;
      default:
        quantize_q8_1_block(static_cast<const float*>(x) + b * kSubSize, xq + b * kSubSize,
                            xds + b);
        break;
    }
  }
}

// out[t, row] for NUM_TOKENS tokens (the launcher passes num_tokens <= NUM_TOKENS; the missing
// ones repeat the last token and are not stored). blockDim.x / 32 rows per thread block.
//   out:    [num_tokens, output_size] (row stride out_stride), of out_dtype
//   weight: [output_size, num_blocks blocks] (row stride weight_row_stride_bytes)
//   xq:     [num_tokens, input_size] int8,  xds: [num_tokens, input_size / 32]  (not FUSE_X)
//   x:      [input_size] of out_dtype, 16-byte aligned  (FUSE_X: NUM_TOKENS == 1)
template <int TYPE, int NUM_TOKENS, int SUBS_PER_LANE, bool FUSE_X>
__global__ void __launch_bounds__((FUSE_X ? kMmvqMaxWarps : kMmvqWarps) * kWarpSize)
    mul_mat_vec_kernel(void* __restrict__ out, DType out_dtype, const uint8_t* __restrict__ weight,
                       const int8_t* __restrict__ xq, const Q81Scale* __restrict__ xds,
                       const void* __restrict__ x, int num_tokens, int64_t output_size,
                       int64_t input_size, int64_t weight_row_stride_bytes, int64_t out_stride,
                       int num_stages, bool l2_256) {
  static_assert(!FUSE_X || NUM_TOKENS == 1, "FUSE_X quantizes one token");
  using Traits = BlockTraits<TYPE>;
  using Tile = MmvqTile<TYPE, SUBS_PER_LANE>;
  extern __shared__ uint4 mmvq_smem[];  // [warps][num_stages][kStageChunks], then FUSE_X's x
  const int warps = blockDim.x / kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  // The warp's rows: row0, row0 + row_step, ... (one where the grid covers every row; FUSE_X
  // caps the grid at the resident blocks, so each block quantizes x once for several rows).
  const int64_t row_step = int64_t(gridDim.x) * warps;
  const int64_t row0 = int64_t(blockIdx.x) * warps + warp;
  // Whole warps leave; with FUSE_X they stay for the block's quantization and its barrier.
  if (!FUSE_X && row0 >= output_size) return;
  const int64_t num_blocks = input_size / Traits::kBlockSize;
  const int64_t row_bytes = num_blocks * Traits::kBlockBytes;
  const int64_t num_subs = input_size / kSubSize;
  const int num_tiles = static_cast<int>((num_blocks + Tile::kBlocks - 1) / Tile::kBlocks);
  const uint8_t* weight_end = weight + (output_size - 1) * weight_row_stride_bytes + row_bytes;
  uint4* ring = mmvq_smem + int64_t(warp) * num_stages * Tile::kStageChunks;
  if constexpr (FUSE_X) {
    int8_t* x_q =
        reinterpret_cast<int8_t*>(mmvq_smem + int64_t(warps) * num_stages * Tile::kStageChunks);
    xq = x_q;
    xds = reinterpret_cast<const Q81Scale*>(x_q + (input_size + 15) / 16 * 16);
  }
  // A row's tiles are copied from the 16-byte boundary at or below its start.
  auto misalign_of = [&](int64_t row) {
    return static_cast<int>(reinterpret_cast<uintptr_t>(weight + row * weight_row_stride_bytes) %
                            16);
  };

  // Copies tile t of `row` into ring slot `slot`. A tile wholly inside the weight (all but the
  // first of a misaligned tensor and the last row's end) is copied without per-chunk checks: the
  // instructions per tile, not the bytes, bounded these kernels (ncu, Q4_K down at M = 1: ~350
  // warp instructions per 1152-byte tile, under half of them the two sub-blocks' decode and dot
  // products; the rest ring indices by division, per-chunk bounds checks and a jump table).
  // Chunks at the tensor's ends are loaded and stored (visible after the __syncwarp that
  // precedes their use, like the copies).
  auto issue_tile = [&](int64_t row, int t, int slot) {
    const int misalign = misalign_of(row);
    const int num_chunks = Tile::kChunks + (misalign != 0);  // uniform across the warp
    uint4* stage = ring + slot * Tile::kStageChunks;
    const uint8_t* src =
        weight + row * weight_row_stride_bytes - misalign + int64_t(t) * Tile::kBytes;
    if (src >= weight && src + 16 * num_chunks <= weight_end) {  // uniform across the warp
      if (l2_256) {
        for (int c = lane; c < num_chunks; c += kWarpSize) {
          cp_async_16(stage + c, src + 16 * c, true);
        }
      } else {
        for (int c = lane; c < num_chunks; c += kWarpSize) {
          cp_async_16(stage + c, src + 16 * c, false);
        }
      }
      return;
    }
    for (int c = lane; c < num_chunks; c += kWarpSize) {
      const uint8_t* p = src + 16 * c;
      if (p >= weight && p + 16 <= weight_end) {
        cp_async_16(stage + c, p, l2_256);
      } else {
        stage[c] = load_chunk_edge(p, weight, weight_end);
      }
    }
  };
  // The copies run ahead of the reads through the warp's (row, tile) sequence.
  int64_t issue_row = row0;
  int issue_t = 0;
  auto issue_next = [&](int slot) {
    if (issue_row >= output_size) return;
    issue_tile(issue_row, issue_t, slot);
    if (++issue_t == num_tiles) {
      issue_t = 0;
      // One row per warp without FUSE_X (its grid covers every row): no row state to carry.
      issue_row = FUSE_X ? issue_row + row_step : output_size;
    }
  };
  float acc[NUM_TOKENS];
#pragma unroll
  for (int t = 0; t < NUM_TOKENS; ++t) acc[t] = 0.f;

  // Under PDL this runs while the kernel before it finishes: weights first, then wait for x.
  for (int i = 0; i < num_stages - 1; ++i) {
    issue_next(i);
    cp_async_commit();  // one group per tile slot, empty or not, so the count below holds
  }
  pdl_wait();
  if constexpr (FUSE_X) {
    quantize_x_to_smem(x, out_dtype, input_size, const_cast<int8_t*>(xq),
                       const_cast<Q81Scale*>(xds));
    __syncthreads();
    if (row0 >= output_size) return;
    // The next kernel may be scheduled now: its blocks take the SM room this grid leaves and
    // request their first weights while this one streams (same H100, bench_gguf M = 1, layer of
    // four Llama-3-8B products: Q4_K 62.6 -> 60.6 us, Q8_0 96.1 -> 94.1, Q6_K 84.2 -> 81.7).
    // The q8_1 kernel's form keeps the late trigger: several tokens measured slower with it.
    pdl_launch_dependents();
  }
  // Sub-block s of the lane in the tile whose bytes start at tile_bytes (block0: its first block).
  auto dot_sub = [&](const uint8_t* tile_bytes, int64_t block0, int s) {
    const int u = lane + s * kWarpSize;  // sub-block within the tile
    const int b = u / Tile::kSubsPerBlock;
    const int64_t sub_idx = (block0 + b) * Tile::kSubsPerBlock + u % Tile::kSubsPerBlock;
    Sub32 w;
    Traits::unpack(tile_bytes + b * Traits::kBlockBytes, u % Tile::kSubsPerBlock, w);
#pragma unroll
    for (int t2 = 0; t2 < NUM_TOKENS; ++t2) {
      const int tok = t2 < num_tokens ? t2 : num_tokens - 1;
      acc[t2] += sub_dot_q8_1<kScalePer32<TYPE>>(w, xq + tok * input_size + sub_idx * kSubSize,
                                                 xds[tok * (input_size / kSubSize) + sub_idx]);
    }
  };
  int64_t row = row0;  // the row being read
  int misalign = misalign_of(row);
  int t = 0;     // its tile
  int slot = 0;  // that tile's ring slot, kept without a division
  while (row < output_size) {
    // The slot refilled here (the one before this tile's) was last read in the previous
    // iteration, which ended with __syncwarp.
    issue_next(slot == 0 ? num_stages - 1 : slot - 1);
    cp_async_commit();
    cp_async_wait(num_stages - 1);  // this tile's copies (this lane's) have landed
    __syncwarp();                   // ... and every lane's
    // Where the decoders read: misalign keeps 4-byte fields 4-byte aligned (the API checks rows
    // of such types are).
    const uint8_t* tile_bytes =
        reinterpret_cast<const uint8_t*>(ring + slot * Tile::kStageChunks) + misalign;
    const int64_t block0 = int64_t(t) * Tile::kBlocks;
    // With several tokens, one sub-block at a time: unrolled, the decoded sub-blocks and the
    // tokens' accumulators outgrew the registers (up to 188 at 8 tokens).
    constexpr int kUnrollSubs = NUM_TOKENS > 2 ? 1 : Tile::kSubsPerLane;
    // A whole tile needs no per-sub-block check (with several tokens the one guarded loop is
    // kept: the second copy of the loop cost registers there).
    if (NUM_TOKENS <= 2 && (block0 + Tile::kBlocks) * Tile::kSubsPerBlock <= num_subs) {
#pragma unroll
      for (int s = 0; s < Tile::kSubsPerLane; ++s) dot_sub(tile_bytes, block0, s);
    } else {
#pragma unroll kUnrollSubs
      for (int s = 0; s < Tile::kSubsPerLane; ++s) {
        const int u = lane + s * kWarpSize;
        if ((block0 + u / Tile::kSubsPerBlock) * Tile::kSubsPerBlock < num_subs) {
          dot_sub(tile_bytes, block0, s);
        }
      }
    }
    __syncwarp();  // the slot is refilled by a later iteration
    slot = slot + 1 == num_stages ? 0 : slot + 1;
    if (++t == num_tiles) {  // the row is done
#pragma unroll
      for (int t2 = 0; t2 < NUM_TOKENS; ++t2) {
        const float v = warp_reduce_sum(acc[t2]);
        if (lane == 0 && t2 < num_tokens) store_as(out, out_dtype, t2 * out_stride + row, v);
        acc[t2] = 0.f;
      }
      if constexpr (!FUSE_X) break;
      t = 0;
      row += row_step;
      if (row < output_size) misalign = misalign_of(row);
    }
  }
  if constexpr (!FUSE_X) pdl_launch_dependents();
}

// The kernel a launch runs (subs_per_lane 2 or 4; FUSE_X only where NUM_TOKENS == 1).
template <int TYPE, int NUM_TOKENS, bool FUSE_X>
auto* mul_mat_vec_kernel_for(int subs_per_lane) {
  return subs_per_lane == 4 ? mul_mat_vec_kernel<TYPE, NUM_TOKENS, 4, FUSE_X>
                            : mul_mat_vec_kernel<TYPE, NUM_TOKENS, 2, FUSE_X>;
}

// Dynamic shared memory of one launch.
template <int TYPE>
size_t mul_mat_vec_smem(int warps, int subs_per_lane, int num_stages, bool fuse_x,
                        int64_t input_size) {
  return subs_per_lane == 4 ? mmvq_smem_bytes<TYPE, 4>(warps, num_stages, fuse_x, input_size)
                            : mmvq_smem_bytes<TYPE, 2>(warps, num_stages, fuse_x, input_size);
}

// Thread blocks of the form that one SM holds at once (0: it does not fit), from the occupancy
// calculator (the host caches it: mmvq_resident_blocks in gguf.cu).
template <int TYPE, int NUM_TOKENS, bool FUSE_X>
int mul_mat_vec_resident_blocks(int warps, int subs_per_lane, size_t smem) {
  auto* kernel = mul_mat_vec_kernel_for<TYPE, NUM_TOKENS, FUSE_X>(subs_per_lane);
  int blocks = 0;
  if (smem > 48 * 1024 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem)) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, warps * kWarpSize, smem) !=
      cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return blocks;
}

// warps: rows per thread block (1..kMmvqMaxWarps); subs_per_lane: 2 or 4 (the tile size);
// num_stages: 2..4 (tiles in flight + 1); l2_256: the copies' L2::256B prefetch hint; pdl: launch
// with programmatic dependent launch. FUSE_X reads x (16-byte aligned) instead of xq / xds.
// max_blocks > 0 caps the grid (the warps then take several rows each).
template <int TYPE, int NUM_TOKENS, bool FUSE_X>
cudaError_t launch_mul_mat_vec(void* out, DType out_dtype, const uint8_t* weight, const int8_t* xq,
                               const Q81Scale* xds, const void* x, int num_tokens,
                               int64_t output_size, int64_t input_size,
                               int64_t weight_row_stride_bytes, int64_t out_stride, int warps,
                               int64_t max_blocks, int subs_per_lane, int num_stages, bool l2_256,
                               bool pdl, cudaStream_t stream) {
  const size_t smem = mul_mat_vec_smem<TYPE>(warps, subs_per_lane, num_stages, FUSE_X, input_size);
  auto* kernel = mul_mat_vec_kernel_for<TYPE, NUM_TOKENS, FUSE_X>(subs_per_lane);
  if (smem > 48 * 1024) {
    int device = 0, max_smem = 0;
    PYORCH_RETURN_IF_ERROR(cudaGetDevice(&device));
    PYORCH_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (smem > static_cast<size_t>(max_smem)) {
      PYORCH_INVALID(
          "gguf_mul_mat_vec: %d rows per block, %d stages of %d sub-blocks per lane%s take %zu "
          "bytes of shared memory (at most %d)",
          warps, num_stages, subs_per_lane, FUSE_X ? " and x" : "", smem, max_smem);
    }
    PYORCH_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(smem)));
  }
  int64_t grid = (output_size + warps - 1) / warps;
  if (max_blocks > 0 && grid > max_blocks) grid = max_blocks;
  return launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(warps * kWarpSize), smem,
                       stream, pdl, out, out_dtype, weight, xq, xds, x, num_tokens, output_size,
                       input_size, weight_row_stride_bytes, out_stride, num_stages, l2_256);
}

}  // namespace pyorch::kernels::gguf
