// The W4A16 GEMM for decode (m <= kW4A16StreamMaxRows), built for the weight-read floor: the
// codes reach shared memory by TMA bulk copies (cp.async.bulk, sm_90) instead of register loads,
// so a warp keeps many kilobytes in flight without holding registers for them and computes while
// they land.
//
// Each warp owns one 16-column n-tile (the tiles of pyorch/w4a16.h keep a tile's k-blocks
// contiguous) and streams its k-range through a private ring of `stages` slots of kW4StreamChunk
// k-blocks (512 bytes each): lane 0 issues one bulk copy per slot with an mbarrier that completes
// on the bytes; every lane waits on the slot's barrier, copies its 16 bytes per block into
// registers, the warp syncs, lane 0 refills the slot with the chunk `stages` ahead, and the warp
// dequantizes and multiplies the chunk in registers (scales and zero points are loaded one chunk
// ahead) (lop3 + sub + mul, mma.sync: the arithmetic
// of w4a16_gemm.cuh, shared with it). The grid and the deterministic k-split reduction are those
// of w4a16_gemm_kernel.
//
// Under PDL (pdl_enabled()) the barriers' set-up, the first `stages` chunks' copies and the first
// scales (weights: nothing writes them while the model runs) are issued before waiting for the
// kernel before it; activations, partials, counters and the output are touched after. The next
// kernel may be scheduled once every warp has streamed its range (before the epilogue and the
// k-split's reduction), so its first weight copies overlap this kernel's tail rather than its
// stream.
#pragma once

#include <cstdint>

#include "common/launch.cuh"
#include "pyorch/launch.h"
#include "w4a16/w4a16_gemm.cuh"

namespace pyorch::kernels {

constexpr int kW4StreamChunk = 4;  // k-blocks per bulk copy (2 KiB per warp)
constexpr int kW4StreamMaxStages = 8;
constexpr int kW4StreamChunkWords = kW4StreamChunk * 32;  // uint4 per chunk

__device__ __forceinline__ uint32_t w4_smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <typename T>
__device__ __forceinline__ float w4_scale_value(uint32_t bits) {
  const uint16_t b = static_cast<uint16_t>(bits);
  return to_float(*reinterpret_cast<const T*>(&b));
}

__device__ __forceinline__ void w4_mbarrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(w4_smem_addr(bar)) : "memory");
}

// The bulk copy of `bytes` (a multiple of 16) from global src to shared dst, completing on bar.
__device__ __forceinline__ void w4_bulk_copy(void* dst, const void* src, uint32_t bytes,
                                             uint64_t* bar) {
  const uint32_t b = w4_smem_addr(bar);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(w4_smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(b)
      : "memory");
}

__device__ __forceinline__ void w4_mbarrier_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t b = w4_smem_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(b), "r"(parity)
        : "memory");
  } while (!done);
}

// Dynamic shared memory of one thread block: the warps' rings, then their barriers.
inline size_t w4_stream_smem_bytes(int stages) {
  return static_cast<size_t>(kW4Warps) * stages * (kW4StreamChunkWords * sizeof(uint4) + 8);
}

// Dynamic shared memory a launch may take without opting in.
constexpr size_t kW4StreamDefaultSmem = 48 * 1024;

// grid (ceil(n / 64), num_splits), kW4Threads threads, w4_stream_smem_bytes(stages) bytes.
// GROUP_SCALE: the group size is a multiple of the 64-row k-block (groups of blocks_per_group
// whole blocks): the codes are only centred in registers and each group's fp32 sums are scaled
// once (16 fewer 16-bit multiplies per lane per block; the weights are not rounded to 16 bits,
// which is closer to the exact product than the contract's single rounding). Else (group 32)
// each weight is scaled in registers as in w4a16_gemm.cuh.
template <typename T, int M_TILES, bool HAS_ZEROS, bool GROUP_SCALE, bool PREFETCH_ACTS>
__global__ void __launch_bounds__(kW4Threads)
    w4a16_stream_kernel(const W4A16GemmArgs p, int stages) {
  extern __shared__ __align__(128) unsigned char w4_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  uint4* ring = reinterpret_cast<uint4*>(w4_smem) + warp * stages * kW4StreamChunkWords;
  uint64_t* bars = reinterpret_cast<uint64_t*>(w4_smem + kW4Warps * stages * kW4StreamChunkWords *
                                                             sizeof(uint4)) +
                   warp * stages;
  const int64_t nt = static_cast<int64_t>(blockIdx.x) * kW4Warps + warp;
  const int kblocks = p.k / static_cast<int>(kW4A16BlockK);
  const int kb_begin = blockIdx.y * p.blocks_per_split;
  const int kb_end = min(kb_begin + p.blocks_per_split, kblocks);
  const bool valid_tile = nt < p.n / kW4A16TileN;
  float acc[M_TILES][4] = {};
  float part[M_TILES][4] = {};  // GROUP_SCALE: the current group's unscaled sums
  const int blocks_per_group = GROUP_SCALE ? p.group_size / static_cast<int>(kW4A16BlockK) : 1;
  const bool bpg_pow2 = (blocks_per_group & (blocks_per_group - 1)) == 0;
  if (valid_tile && kb_begin < kb_end) {
    const uint4* warp_codes = p.b_q + nt * kblocks * 32;  // block kb at warp_codes + 32 kb
    const int nchunks = (kb_end - kb_begin + kW4StreamChunk - 1) / kW4StreamChunk;
    auto issue = [&](int c) {  // lane 0: chunk c into its slot
      const int kb = kb_begin + c * kW4StreamChunk;
      const int blocks = min(kW4StreamChunk, kb_end - kb);
      const int slot = c % stages;
      w4_bulk_copy(ring + slot * kW4StreamChunkWords, warp_codes + kb * 32,
                   static_cast<uint32_t>(blocks * 32 * sizeof(uint4)), &bars[slot]);
    };
    if (lane == 0) {
      for (int s = 0; s < stages; ++s) w4_mbarrier_init(&bars[s]);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      for (int c = 0; c < min(stages, nchunks); ++c) issue(c);
    }
    __syncwarp();
    // Scales and zero points one chunk ahead in registers (they come from HBM too).
    W4Stage st[kW4StreamChunk], next[kW4StreamChunk];
    auto load_groups = [&](int c, W4Stage(&dst)[kW4StreamChunk]) {
      const int kb0 = kb_begin + c * kW4StreamChunk;
#pragma unroll
      for (int j = 0; j < kW4StreamChunk; ++j) {
        if (kb0 + j < kb_end) w4_load_group<T, HAS_ZEROS>(p, nt, kb0 + j, lane, &dst[j]);
      }
    };
    load_groups(0, st);
    pdl_wait();  // a (in w4_compute_stage / w4_load_acts) comes from the kernel before
    // PREFETCH_ACTS: the activations of the next k-block are loaded before this one's dequant
    // and mma, so their L1 latency is hidden behind that work instead of stalling it.
    W4Acts<M_TILES> acts;
    if constexpr (PREFETCH_ACTS) w4_load_acts<T, M_TILES>(p, kb_begin, lane, &acts);
    for (int c = 0; c < nchunks; ++c) {
      const int kb0 = kb_begin + c * kW4StreamChunk;
      const int blocks = min(kW4StreamChunk, kb_end - kb0);
      if (c + 1 < nchunks) load_groups(c + 1, next);
      const int slot = c % stages;
      w4_mbarrier_wait(&bars[slot], static_cast<uint32_t>((c / stages) & 1));
      const uint4* src = ring + slot * kW4StreamChunkWords;
#pragma unroll
      for (int j = 0; j < kW4StreamChunk; ++j) {
        if (j < blocks) st[j].codes = src[j * 32 + lane];
      }
      __syncwarp();  // every lane holds its codes: the slot may be refilled
      if (lane == 0 && c + stages < nchunks) issue(c + stages);
#pragma unroll
      for (int j = 0; j < kW4StreamChunk; ++j) {
        if (j >= blocks) continue;
        W4Acts<M_TILES> cur;
        if constexpr (PREFETCH_ACTS) {
          cur = acts;
          if (kb0 + j + 1 < kb_end) w4_load_acts<T, M_TILES>(p, kb0 + j + 1, lane, &acts);
        }
        if constexpr (GROUP_SCALE) {
          // Centred codes into part; at the end of the block's group (or of the range) part
          // times the group's scales goes into acc.
          const int kb = kb0 + j;
          if constexpr (PREFETCH_ACTS) {
            w4_compute_acts<T, M_TILES, HAS_ZEROS, false>(st[j], cur, part);
          } else {
            w4_compute_stage<T, M_TILES, HAS_ZEROS, false>(p, st[j], kb, lane, part);
          }
          const bool group_end = bpg_pow2 ? ((kb + 1) & (blocks_per_group - 1)) == 0
                                          : (kb + 1) % blocks_per_group == 0;
          if (group_end || kb + 1 == kb_end) {
            const float s_lo = w4_scale_value<T>(st[j].scales & 0xFFFF);
            const float s_hi = w4_scale_value<T>(st[j].scales >> 16);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                acc[mt][i] = fmaf(part[mt][i], i < 2 ? s_lo : s_hi, acc[mt][i]);
                part[mt][i] = 0.f;
              }
            }
          }
        } else if constexpr (PREFETCH_ACTS) {
          w4_compute_acts<T, M_TILES, HAS_ZEROS>(st[j], cur, acc);
        } else {
          w4_compute_stage<T, M_TILES, HAS_ZEROS>(p, st[j], kb0 + j, lane, acc);
        }
      }
#pragma unroll
      for (int j = 0; j < kW4StreamChunk; ++j) {
        st[j].scales = next[j].scales;
        st[j].zeros = next[j].zeros;
      }
    }
  } else {
    pdl_wait();
  }
  pdl_launch_dependents();
  w4_store_or_reduce<T, M_TILES>(p, acc, nt, valid_tile, g, t);
}

template <typename T>
cudaError_t launch_w4a16_stream(const W4A16GemmArgs& p, bool has_zeros, int stages,
                                bool prefetch_acts, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.n + kW4A16BlockN - 1) / kW4A16BlockN),
                  static_cast<unsigned>(p.num_splits));
  const size_t smem = w4_stream_smem_bytes(stages);
  cudaError_t err = cudaSuccess;
  const bool group_scale = p.group_size % kW4A16BlockK == 0;
  auto launch = [&](auto m_tiles, auto zeros) {
    constexpr int kTiles = decltype(m_tiles)::value;
    constexpr bool kZeros = decltype(zeros)::value;
    auto* kernel = group_scale
                       ? (prefetch_acts ? &w4a16_stream_kernel<T, kTiles, kZeros, true, true>
                                        : &w4a16_stream_kernel<T, kTiles, kZeros, true, false>)
                       : (prefetch_acts ? &w4a16_stream_kernel<T, kTiles, kZeros, false, true>
                                        : &w4a16_stream_kernel<T, kTiles, kZeros, false, false>);
    if (smem > kW4StreamDefaultSmem) {  // deeper rings than 5 slots (the benchmark's sweep)
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(smem));
      if (err != cudaSuccess) return;
    }
    err = launch_kernel(kernel, grid, dim3(kW4Threads), smem, stream, pdl_enabled(), p, stages);
  };
  auto with_tiles = [&](auto zeros) {
    if (p.m <= 8) {
      launch(std::integral_constant<int, 1>{}, zeros);
    } else {
      launch(std::integral_constant<int, 2>{}, zeros);
    }
  };
  if (has_zeros) {
    with_tiles(std::true_type{});
  } else {
    with_tiles(std::false_type{});
  }
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace pyorch::kernels
