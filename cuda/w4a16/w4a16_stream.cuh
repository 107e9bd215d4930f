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
// dequantizes and multiplies the chunk in registers (lop3 + sub, mma.sync: the arithmetic of
// w4a16_gemm.cuh, shared with it). The grid and the deterministic k-split reduction are those
// of w4a16_gemm_kernel. Two forms: the grouped one (group sizes of whole k-blocks: scales applied
// to each group's fp32 sums) and the per-weight one (smaller groups: each weight scaled).
//
// Under PDL (pdl_enabled()) the barriers' set-up, the first `stages` chunks' copies and the first
// scales (weights: nothing writes them while the model runs) are issued before waiting for the
// kernel before it; activations, partials, counters and the output are touched after. The next
// kernel may be scheduled once every warp has streamed its range (before the epilogue and the
// k-split's reduction), so its first weight copies overlap this kernel's tail rather than its
// stream.
#pragma once

#include <cstdint>
#include <type_traits>

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

// The bulk copy of `bytes` (a multiple of 16) from global src to shared dst, completing on the
// barrier at shared address b (its bytes already expected there).
__device__ __forceinline__ void w4_bulk_copy_issue(void* dst, const void* src, uint32_t bytes,
                                                   uint32_t b) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(w4_smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(b)
      : "memory");
}

// A bulk copy completing on bar, with the phase's one arrival.
__device__ __forceinline__ void w4_bulk_copy(void* dst, const void* src, uint32_t bytes,
                                             uint64_t* bar) {
  const uint32_t b = w4_smem_addr(bar);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes)
               : "memory");
  w4_bulk_copy_issue(dst, src, bytes, b);
}

// A further bulk copy completing on bar in the same phase (its bytes expected, no arrival): the
// phase's one arrival is w4_bulk_copy's.
__device__ __forceinline__ void w4_bulk_copy_more(void* dst, const void* src, uint32_t bytes,
                                                  uint64_t* bar) {
  const uint32_t b = w4_smem_addr(bar);
  asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
  w4_bulk_copy_issue(dst, src, bytes, b);
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

// The scales of one group for a lane's two columns (n_lo = 16 nt + g and n_lo + 8) and the
// packed zero-point words holding them, as loaded.
struct W4GroupQ {
  uint32_t s_lo, s_hi;  // the scales' 16 bits
  uint32_t z_lo, z_hi;  // zero-point words of columns 16 nt .. + 7 and 16 nt + 8 .. + 15
};

// Dynamic shared memory of one thread block: the warps' rings, then their barriers.
inline size_t w4_stream_smem_bytes(int stages) {
  return static_cast<size_t>(kW4Warps) * stages * (kW4StreamChunkWords * sizeof(uint4) + 8);
}

// Dynamic shared memory a launch may take without opting in.
constexpr size_t kW4StreamDefaultSmem = 48 * 1024;

// The per-weight form, for group sizes that are not whole 64-row k-blocks (16, 32, 48, ...): each
// weight is dequantized to T ((q - z) * s, one rounding) in registers as in w4a16_gemm.cuh.
// grid (ceil(n / 64), num_splits), kW4Threads threads, w4_stream_smem_bytes(stages) bytes.
template <typename T, int M_TILES, bool HAS_ZEROS, bool PREFETCH_ACTS>
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
        if constexpr (PREFETCH_ACTS) {
          const W4Acts<M_TILES> cur = acts;
          if (kb0 + j + 1 < kb_end) w4_load_acts<T, M_TILES>(p, kb0 + j + 1, lane, &acts);
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

// The grouped form, for group sizes of whole 64-row k-blocks (every GPTQ / AWQ checkpoint in
// practice: 64, 128, per-channel), written for few instructions per byte of codes: at M = 1 the
// kernel is bound by instruction issue, not by DRAM (an ncu profile of the per-block form above
// had the issue slots 43% busy at 38% of DRAM peak, with ~140 instructions per 512-byte k-block
// in its SASS).
// - The codes are only centred in registers (lop3 + sub: q - z is exact in 16 bits) and each
//   group's fp32 sums are scaled once when the group ends. (Taking magic + q into the mma as is
//   and subtracting (magic + z) times the activations with a second mma per k-tile was slower on
//   an H100 at every shape: 8B decode chain 2.86 against 2.72 ms.)
// - Chunks of CHUNK k-blocks (CHUNK x 512 bytes per warp and slot), read from shared memory block
//   by block; the slot is refilled once the warp is done with it.
// - GROUP_BLOCKS (2: groups of 128) places the group ends at fixed k-blocks of the unrolled
//   chunk: the launch keeps every range on whole groups (w4a16.cu rounds the k-split to an even
//   number of k-blocks). 0: any group of whole k-blocks, tracked by a count of k-blocks left (no
//   division per block). The scales and zero points of the next two groups are in flight while
//   the current one is computed.
// - The activations of the next k-block are loaded before the current one is dequantized, from
//   row pointers set up once; rows past m read row m - 1 (their sums are never stored), so no
//   load is predicated on the row. ACTS_AHEAD = false (9..16 rows only) loads each k-block's own
//   activations just before its dequant instead: 64 registers against 96 in the GPTQ form, 8
//   resident blocks per SM instead of 5, for the launches whose blocks would not all be
//   resident otherwise (w4_stream_plan in w4a16.cu).
// - The ring depth is a power of two (slot and barrier phase by mask and shift).
// - PDL: the next kernel may launch once every block has streamed its range (as the per-weight
//   form). Letting it launch as soon as the blocks had issued their first copies was slower on an
//   H100 (8B decode chain 2.33 against 2.22 ms at M = 1; 8B GPTQ decode 2.98 against 3.02
//   ms/token, within the spread).
// grid (ceil(n / 64), num_splits), kW4Threads threads,
// w4_grouped_smem_bytes(CHUNK, 1 << log2_stages, BY_COPY && GROUP_BLOCKS > 0).
// Per slot and group of 128 rows in it, by copy: the warp's 16 scales, then the 16-byte window of
// zero-point words holding its two.
constexpr int kW4GroupScaleBytes = 32, kW4GroupZeroBytes = 16;

inline size_t w4_grouped_slot_bytes(int chunk, bool by_copy) {
  return static_cast<size_t>(chunk) * 32 * sizeof(uint4) +
         (by_copy ? static_cast<size_t>(chunk / 2) * (kW4GroupScaleBytes + kW4GroupZeroBytes) : 0);
}

inline size_t w4_grouped_smem_bytes(int chunk, int stages, bool by_copy) {
  return static_cast<size_t>(kW4Warps) * stages * (w4_grouped_slot_bytes(chunk, by_copy) + 8);
}

template <typename T, int M_TILES, bool HAS_ZEROS, int GROUP_BLOCKS, bool BY_COPY, int CHUNK,
          bool ACTS_AHEAD>
__global__ void __launch_bounds__(kW4Threads)
    w4a16_stream_grouped_kernel(const W4A16GemmArgs p, int log2_stages) {
  // The ring set-up mirrors the per-weight form's on purpose: one helper struct for both changed
  // the register allocation and cost ~10% on an H100 (stream_grouped_20261127/run4_*).
  extern __shared__ __align__(128) unsigned char w4_smem[];
  static_assert(GROUP_BLOCKS == 0 || GROUP_BLOCKS == 2, "slots hold CHUNK / 2 groups");
  constexpr bool kByCopy = BY_COPY && GROUP_BLOCKS > 0;  // scales in the slots
  constexpr bool kActsAhead = ACTS_AHEAD || M_TILES == 1;
  constexpr int kW4GroupedChunk = CHUNK;
  constexpr int kW4GroupedChunkWords = CHUNK * 32;  // uint4 of codes per chunk
  // uint4 per slot: the codes, then (by copy) the chunk's scales and zero-point windows.
  constexpr int kSlotWords =
      kW4GroupedChunkWords +
      (kByCopy ? (CHUNK / 2) * (kW4GroupScaleBytes + kW4GroupZeroBytes) / 16 : 0);
  static_assert(kSlotWords * sizeof(uint4) ==
                    CHUNK * 32 * sizeof(uint4) +
                        (kByCopy ? (CHUNK / 2) * (kW4GroupScaleBytes + kW4GroupZeroBytes) : 0),
                "w4_grouped_slot_bytes");
  using T2 = typename W4Traits<T>::T2;
  const int stages = 1 << log2_stages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  uint4* ring = reinterpret_cast<uint4*>(w4_smem) + warp * stages * kSlotWords;
  uint64_t* bars =
      reinterpret_cast<uint64_t*>(w4_smem + kW4Warps * stages * kSlotWords * sizeof(uint4)) +
      warp * stages;
  const int64_t nt = static_cast<int64_t>(blockIdx.x) * kW4Warps + warp;
  const int kblocks = p.k / static_cast<int>(kW4A16BlockK);
  const int kb_begin = blockIdx.y * p.blocks_per_split;
  const int kb_end = min(kb_begin + p.blocks_per_split, kblocks);
  const bool valid_tile = nt < p.n / kW4A16TileN;
  float acc[M_TILES][4] = {};
  if (valid_tile && kb_begin < kb_end) {
    const uint4* warp_codes = p.b_q + nt * kblocks * 32;  // block kb at warp_codes + 32 kb
    const int nblocks = kb_end - kb_begin;
    const int nchunks = (nblocks + kW4GroupedChunk - 1) / kW4GroupedChunk;
    auto issue = [&](int c) {  // lane 0: chunk c into its slot
      const int rel = c * kW4GroupedChunk;
      const int blocks = min(kW4GroupedChunk, nblocks - rel);
      const int slot = c & (stages - 1);
      uint4* dst = ring + slot * kSlotWords;
      if constexpr (kByCopy) {
        // The chunk's groups (the range starts on one): 32 bytes of scales each, and the 16-byte
        // window of zero-point words holding the warp's two (launch: both 16-byte aligned).
        unsigned char* extra = reinterpret_cast<unsigned char*>(dst + kW4GroupedChunkWords);
        const int64_t g0 = (kb_begin + rel) / GROUP_BLOCKS;
        for (int i = 0; i < (blocks + GROUP_BLOCKS - 1) / GROUP_BLOCKS; ++i) {
          w4_bulk_copy_more(extra + i * kW4GroupScaleBytes,
                            static_cast<const uint16_t*>(p.scales) + (g0 + i) * p.n + nt * 16,
                            kW4GroupScaleBytes, &bars[slot]);
          if constexpr (HAS_ZEROS) {
            w4_bulk_copy_more(extra + (CHUNK / 2) * kW4GroupScaleBytes + i * kW4GroupZeroBytes,
                              p.zeros + (g0 + i) * (p.n / 8) + ((nt * 2) & ~int64_t{3}),
                              kW4GroupZeroBytes, &bars[slot]);
          }
        }
      }
      w4_bulk_copy(dst, warp_codes + (kb_begin + rel) * 32,
                   static_cast<uint32_t>(blocks * 32 * sizeof(uint4)), &bars[slot]);
    };
    if (lane == 0) {
      for (int s = 0; s < stages; ++s) w4_mbarrier_init(&bars[s]);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      for (int c = 0; c < min(stages, nchunks); ++c) issue(c);
    }
    __syncwarp();
    // Groups. The scales and zero points stay as they were loaded (W4GroupQ) until their group:
    // an instruction that combined two scales as soon as they were loaded (a PRMT) waited for a
    // DRAM round trip once per group (ncu: long-scoreboard stalls ~47% of the cycles between
    // issues). GROUP_BLOCKS = 2: the chunk's CHUNK / 2 groups each keep a fixed register set,
    // refilled with the group one chunk later as soon as it is used (no register moves, which
    // would wait on the loads); or, BY_COPY, they come with the codes by the slot's bulk copies
    // (no global loads but the activations'). GROUP_BLOCKS = 0: the current group and the next
    // two, rotated at group ends. The first loads are issued before pdl_wait (weights).
    const int blocks_per_group = p.group_size / static_cast<int>(kW4A16BlockK);
    const int last_group = kblocks / blocks_per_group - 1;
    const int group = kb_begin / blocks_per_group;
    int left = blocks_per_group * (group + 1) - kb_begin;  // GROUP_BLOCKS == 0 only
    int ahead = group;  // the group whose scales sc_ptr / z_ptr point at
    const uint16_t* sc_ptr =
        static_cast<const uint16_t*>(p.scales) + static_cast<int64_t>(group) * p.n + nt * 16 + g;
    const uint32_t* z_ptr = p.zeros + static_cast<int64_t>(group) * (p.n / 8) + nt * 2;
    auto load_next = [&]() {  // the scales of group `ahead`, then step (clamped at the last)
      W4GroupQ q;
      q.s_lo = __ldg(sc_ptr);
      q.s_hi = __ldg(sc_ptr + 8);
      q.z_lo = q.z_hi = 0;
      if constexpr (HAS_ZEROS) {
        q.z_lo = __ldg(z_ptr);
        q.z_hi = __ldg(z_ptr + 1);
      }
      if (ahead < last_group) {
        ++ahead;
        sc_ptr += p.n;
        if constexpr (HAS_ZEROS) z_ptr += p.n / 8;
      }
      return q;
    };
    constexpr int kRegGroups = GROUP_BLOCKS == 0 ? 3 : (kByCopy ? 1 : CHUNK / GROUP_BLOCKS);
    W4GroupQ gq[kRegGroups];
    if constexpr (!kByCopy) {
#pragma unroll
      for (int i = 0; i < kRegGroups; ++i) gq[i] = load_next();
    }
    pdl_wait();  // a comes from the kernel before
    // The lane's activation rows (8 mt + g, or m - 1 past m) from k = 64 kb_begin + 16 t.
    const T* arow[M_TILES];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      const int row = min(mt * 8 + g, p.m - 1);
      arow[mt] = static_cast<const T*>(p.a) + row * p.a_stride +
                 static_cast<int64_t>(kb_begin) * kW4A16BlockK + 16 * t;
    }
    auto load_acts = [&](int rel, W4Acts<M_TILES>& x) {  // k-block kb_begin + rel
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        const uint4* ap = reinterpret_cast<const uint4*>(arow[mt] + rel * kW4A16BlockK);
        x.b[mt][0] = __ldg(ap);
        x.b[mt][1] = __ldg(ap + 1);
      }
    };
    W4Acts<M_TILES> acts[kActsAhead ? 2 : 1];
    if constexpr (kActsAhead) load_acts(0, acts[0]);
    float part[M_TILES][4] = {};
    for (int c = 0; c < nchunks; ++c) {
      const int rel0 = c * kW4GroupedChunk;
      const int blocks = min(kW4GroupedChunk, nblocks - rel0);
      const int slot = c & (stages - 1);
      w4_mbarrier_wait(&bars[slot], static_cast<uint32_t>((c >> log2_stages) & 1));
      const uint4* src = ring + slot * kSlotWords + lane;
      const unsigned char* extra =
          reinterpret_cast<const unsigned char*>(ring + slot * kSlotWords + kW4GroupedChunkWords);
#pragma unroll
      for (int j = 0; j < kW4GroupedChunk; ++j) {
        if (j >= blocks) continue;
        const int rel = rel0 + j;
        if constexpr (kActsAhead) {
          if (rel + 1 < nblocks) load_acts(rel + 1, acts[(j + 1) & 1]);
        } else {
          load_acts(rel, acts[0]);
        }
        const W4Acts<M_TILES>& x = acts[kActsAhead ? (j & 1) : 0];
        const uint4 codes = src[j * 32];
        // The group of this k-block, and magic + z of the lane's two columns (rows g and g + 8 of
        // the mma's A operand).
        uint32_t z_lo = 8u, z_hi = 8u;
        if constexpr (HAS_ZEROS) {
          const W4GroupQ& q = gq[GROUP_BLOCKS > 0 && !kByCopy ? j / GROUP_BLOCKS : 0];
          uint32_t zw_lo = q.z_lo, zw_hi = q.z_hi;
          if constexpr (kByCopy) {
            const uint32_t* zw =
                reinterpret_cast<const uint32_t*>(extra + (CHUNK / 2) * kW4GroupScaleBytes +
                                                  (j / GROUP_BLOCKS) * kW4GroupZeroBytes) +
                (nt & 1) * 2;
            zw_lo = zw[0];
            zw_hi = zw[1];
          }
          z_lo = (zw_lo >> (4 * g)) & 0xF;
          z_hi = (zw_hi >> (4 * g)) & 0xF;
        }
        const uint32_t magic16 = W4Traits<T>::kMagic & 0xFFFFu;
        const uint32_t bias_lo = (magic16 | z_lo) * 0x10001u;  // exact: a small integer
        const uint32_t bias_hi = (magic16 | z_hi) * 0x10001u;
        const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
        uint32_t frag[4][4];
#pragma unroll
        for (int kt = 0; kt < 4; ++kt) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const uint32_t pair = w4_code_pair(words[kt] >> (4 * r), W4Traits<T>::kMagic);
            const uint32_t b = (r % 2) ? bias_hi : bias_lo;
            frag[kt][r] = w4_center_pair(pair, *reinterpret_cast<const T2*>(&b));
          }
        }
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          w4_mma_block<T>(part[mt], frag, x.b[mt][0], x.b[mt][1]);
        }
        bool group_end;
        if constexpr (GROUP_BLOCKS > 0) {
          group_end = j % GROUP_BLOCKS == GROUP_BLOCKS - 1;  // ranges start and end on groups
        } else {
          group_end = --left == 0 || rel + 1 == nblocks;  // or the range ends
        }
        if (group_end) {
          const W4GroupQ& q = gq[GROUP_BLOCKS > 0 && !kByCopy ? j / GROUP_BLOCKS : 0];
          uint32_t sb_lo = q.s_lo, sb_hi = q.s_hi;
          if constexpr (kByCopy) {
            const uint16_t* sw =
                reinterpret_cast<const uint16_t*>(extra + (j / GROUP_BLOCKS) * kW4GroupScaleBytes);
            sb_lo = sw[g];
            sb_hi = sw[g + 8];
          }
          const float s_lo = w4_scale_value<T>(sb_lo);
          const float s_hi = w4_scale_value<T>(sb_hi);
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              acc[mt][i] = fmaf(part[mt][i], i < 2 ? s_lo : s_hi, acc[mt][i]);
              part[mt][i] = 0.f;
            }
          }
          if constexpr (GROUP_BLOCKS == 0) {
            left = blocks_per_group;
            gq[0] = gq[1];
            gq[1] = gq[2];
            gq[2] = load_next();
          } else if constexpr (!kByCopy) {
            gq[j / GROUP_BLOCKS] = load_next();
          }
        }
      }
      __syncwarp();  // every lane is done with the slot: it may be refilled
      if (lane == 0 && c + stages < nchunks) issue(c + stages);
    }
  } else {
    pdl_wait();
  }
  pdl_launch_dependents();
  w4_store_or_reduce<T, M_TILES>(p, acc, nt, valid_tile, g, t);
}

// Whether the grouped form (w4a16_stream_grouped_kernel) takes this group size.
inline bool w4_stream_grouped(int group_size) { return group_size % kW4A16BlockK == 0; }

// The ring depth the stream kernels run with: the grouped form takes powers of two only.
inline int w4_stream_log2_stages(int stages) {
  int log2 = 0;
  while ((2 << log2) <= stages) ++log2;
  return log2;
}

template <typename T>
cudaError_t launch_w4a16_stream(const W4A16GemmArgs& p, bool has_zeros, int stages,
                                bool prefetch_acts, int chunk, bool scales_by_copy, bool acts_ahead,
                                cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.n + kW4A16BlockN - 1) / kW4A16BlockN),
                  static_cast<unsigned>(p.num_splits));
  const bool grouped = w4_stream_grouped(p.group_size);
  const int log2_stages = w4_stream_log2_stages(stages);
  if (grouped) stages = 1 << log2_stages;
  chunk = chunk <= 4 ? 4 : 8;
  // Groups of 128 on even k-splits take the fixed group ends; their scales (and zero points)
  // come by the slots' bulk copies when scales_by_copy and the copies may read them: 16-byte
  // aligned rows (n % 32 for the zero-point words, whose 16-byte windows then also stay inside
  // their row).
  const bool fixed_ends = p.group_size == 2 * kW4A16BlockK && p.blocks_per_split % 2 == 0;
  const bool by_copy =
      grouped && fixed_ends && scales_by_copy && reinterpret_cast<uintptr_t>(p.scales) % 16 == 0 &&
      (!has_zeros || (reinterpret_cast<uintptr_t>(p.zeros) % 16 == 0 && p.n % 32 == 0));
  const size_t smem =
      grouped ? w4_grouped_smem_bytes(chunk, stages, by_copy) : w4_stream_smem_bytes(stages);
  cudaError_t err = cudaSuccess;
  auto run = [&](auto* kernel, int stage_arg) {
    if (smem > kW4StreamDefaultSmem) {  // deep rings (the benchmark's sweep)
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(smem));
      if (err != cudaSuccess) return;
    }
    err = launch_kernel(kernel, grid, dim3(kW4Threads), smem, stream, pdl_enabled(), p, stage_arg);
  };
  auto launch = [&](auto m_tiles, auto zeros, auto ahead) {
    constexpr int kTiles = decltype(m_tiles)::value;
    constexpr bool kZeros = decltype(zeros)::value;
    constexpr bool kAhead = decltype(ahead)::value;
    if (grouped) {
      auto with_blocks = [&](auto group_blocks, auto by_copy) {
        constexpr int kGB = decltype(group_blocks)::value;
        constexpr bool kCopy = decltype(by_copy)::value;
        if (chunk == 4) {
          run(&w4a16_stream_grouped_kernel<T, kTiles, kZeros, kGB, kCopy, 4, kAhead>, log2_stages);
        } else {
          run(&w4a16_stream_grouped_kernel<T, kTiles, kZeros, kGB, kCopy, 8, kAhead>, log2_stages);
        }
      };
      if (by_copy) {
        with_blocks(std::integral_constant<int, 2>{}, std::true_type{});
      } else if (fixed_ends) {
        with_blocks(std::integral_constant<int, 2>{}, std::false_type{});
      } else {
        with_blocks(std::integral_constant<int, 0>{}, std::false_type{});
      }
    } else if (prefetch_acts) {
      run(&w4a16_stream_kernel<T, kTiles, kZeros, true>, stages);
    } else {
      run(&w4a16_stream_kernel<T, kTiles, kZeros, false>, stages);
    }
  };
  auto with_tiles = [&](auto zeros) {
    if (p.m <= 8) {
      launch(std::integral_constant<int, 1>{}, zeros, std::true_type{});
    } else if (acts_ahead || !grouped) {
      launch(std::integral_constant<int, 2>{}, zeros, std::true_type{});
    } else {
      launch(std::integral_constant<int, 2>{}, zeros, std::false_type{});
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

// Thread blocks of the grouped stream kernel resident per SM (the CUDA occupancy calculator on the
// bf16 GPTQ form with groups of 128: the register count of each row form sets it), for the launch
// plan (w4_stream_plan). m_tiles 1 or 2; 0 when the query fails.
inline int w4_stream_resident_blocks(int m_tiles, bool acts_ahead, int chunk, int stages) {
  using T = __nv_bfloat16;
  chunk = chunk <= 4 ? 4 : 8;
  const int log2_stages = w4_stream_log2_stages(stages);
  const size_t smem = w4_grouped_smem_bytes(chunk, 1 << log2_stages, false);
  int blocks = 0;
  auto query = [&](auto* kernel) {
    if ((smem > kW4StreamDefaultSmem &&
         cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem)) != cudaSuccess) ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kW4Threads, smem) !=
            cudaSuccess) {
      blocks = 0;
      cudaGetLastError();  // the failed query's own error: the caller then plans without it
    }
  };
  auto with_chunk = [&](auto m, auto ahead) {
    constexpr int kM = decltype(m)::value;
    constexpr bool kA = decltype(ahead)::value;
    if (chunk == 4) {
      query(&w4a16_stream_grouped_kernel<T, kM, false, 2, false, 4, kA>);
    } else {
      query(&w4a16_stream_grouped_kernel<T, kM, false, 2, false, 8, kA>);
    }
  };
  if (m_tiles <= 1) {
    with_chunk(std::integral_constant<int, 1>{}, std::true_type{});
  } else if (acts_ahead) {
    with_chunk(std::integral_constant<int, 2>{}, std::true_type{});
  } else {
    with_chunk(std::integral_constant<int, 2>{}, std::false_type{});
  }
  return blocks;
}

}  // namespace pyorch::kernels
