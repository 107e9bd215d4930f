// The Hopper (sm_90a) variant of paged_prefill_kernel: the same work decomposition, paged loads,
// masks, online softmax and epilogue (paged_prefill.cuh), with the two products on warpgroup MMA
// (wgmma.cuh). Each warpgroup owns 64 query rows: S = Q K^T reads Q and K straight from
// 128-byte-swizzled shared memory, P V takes P from registers (the S accumulator layout is the
// A-fragment layout, so P never touches shared memory) and V from shared memory with the
// transpose bit. K/V tiles of kBlockN keys still arrive by cp.async through the block table (a
// cache block holds 16 tokens: a TMA box per block would not pay at that size).
//
// Head sizes 64, 128 and 256 (whole 64-element panels) with fp16/bf16 caches take this kernel;
// head sizes 80/96 and fp8 caches stay on the mma.sync kernel (attention.cu routes them).
//
// TODO(prefill): overlap the softmax of tile j with the Q K^T of tile j + 1 (two S buffers) and
// give the loads to a producer warp (FlashAttention-3's intra-warpgroup pipelining and warp
// specialization), the next steps towards the wgmma ceiling.
#pragma once

#include <cstdint>

#include "attention/paged_prefill.cuh"
#include "attention/wgmma.cuh"

namespace pyorch::kernels {

// CTA shape for head sizes <= 128: {warpgroups of 64 rows, keys per KV tile, stages, CTAs per
// SM}. Several CTAs per SM let one CTA's softmax run under another's MMAs (each warpgroup waits
// for its wgmma groups). Head 256 (128 fp32 O registers per thread) keeps one CTA per SM.
// NOTE(prefill): H100, bf16, head 128, 32/8 heads, causal, TFLOP/s at 8k / 4k (direct launch):
// {2, 64, 2, 2} 401 / 361 (128 registers: ptxas spills 24 bytes and serializes the wgmma's, still
// the fastest); {2, 128, 2, 1} 373 / 338; {1, 64, 2, 2} 337 / 309; {2, 32, 2, 2} 319 / 296;
// {2, 32, 3, 2} 317 / 295; {1, 32, 2, 4} 300 / 280; the mma.sync kernel 329 / 303.
constexpr int kPrefillSm90SmallShape[4] = {2, 64, 2, 2};

template <int HEAD_SIZE>
struct PrefillSm90Shape {
  static constexpr bool kSmall = HEAD_SIZE <= 128;
  static constexpr int kWarpGroups = kSmall ? kPrefillSm90SmallShape[0] : 2;
  static constexpr int kBlockN = kSmall ? kPrefillSm90SmallShape[1] : 64;
  static constexpr int kStages = kSmall ? kPrefillSm90SmallShape[2] : 2;
  static constexpr int kMinBlocksPerSm = kSmall ? kPrefillSm90SmallShape[3] : 1;
};

template <typename T, int HEAD_SIZE, class Shape>
struct PrefillSm90Tile {
  static constexpr bool kFp8 = false;
  static constexpr int kHeadSize = HEAD_SIZE;
  static constexpr int kWarpGroups = Shape::kWarpGroups;
  static constexpr int kWarps = 4 * kWarpGroups;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kMTiles = 1;  // per warp: the 16 rows of its share of the m64 wgmma
  static constexpr int kWarpRows = 16;
  static constexpr int kBlockM = 64 * kWarpGroups;
  static constexpr int kBlockN = Shape::kBlockN;
  static constexpr int kStages = Shape::kStages;
  static constexpr int kChunkElems = 16 / sizeof(T);
  static constexpr int kCacheChunkElems = kChunkElems;
  static constexpr int kSTiles = kBlockN / 8;
  static constexpr int kOTiles = HEAD_SIZE / 8;
  static constexpr int kQBytes = kBlockM * HEAD_SIZE * static_cast<int>(sizeof(T));
  static constexpr int kKvTileBytes = kBlockN * HEAD_SIZE * static_cast<int>(sizeof(T));
  // + one swizzle atom: the dynamic shared memory base is only 16-byte aligned.
  static constexpr size_t kSmemBytes =
      wgmma::kSwizzleAtomBytes + kQBytes + 2 * kStages * kKvTileBytes;

  static __device__ __forceinline__ int q_chunk_offset(int row, int col) {
    return wgmma::swizzled_chunk_offset(row, col, kBlockM);
  }
  static __device__ __forceinline__ int kv_chunk_offset(int key, int col) {
    return wgmma::swizzled_chunk_offset(key, col, kBlockN);
  }

  static_assert(sizeof(T) == 2, "wgmma takes fp16/bf16 here");
  static_assert(HEAD_SIZE % wgmma::kPanelElems == 0, "whole 64-element panels");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256 && HEAD_SIZE <= 256, "wgmma n <= 256");
  static_assert(kStages >= 2, "the ring needs a stage to compute and one to fill");
  static_assert(kSmemBytes * Shape::kMinBlocksPerSm <= 227 * 1024, "fits Hopper shared memory");
};

// S[64 rows][kBlockN keys] of this warpgroup = Q K^T (unscaled). q_desc/k_desc: descriptors of
// the warpgroup's first Q row and of the tile's first key (panel 0, chunk 0). 16 head dims per
// step: 32 bytes along a panel row, then the next panel.
template <class Tr, typename T>
__device__ __forceinline__ void sm90_scores(uint64_t q_desc, uint64_t k_desc,
                                            float (&s)[Tr::kSTiles * 4]) {
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < Tr::kOTiles / 2; ++kk) {
    const uint32_t step = (kk % 4) * 32;
    const uint32_t q_off = (kk / 4) * Tr::kBlockM * wgmma::kPanelRowBytes + step;
    const uint32_t k_off = (kk / 4) * Tr::kBlockN * wgmma::kPanelRowBytes + step;
    wgmma::Wgmma<T, Tr::kBlockN>::ss(s, wgmma::desc_add(q_desc, q_off),
                                     wgmma::desc_add(k_desc, k_off), kk > 0 ? 1 : 0);
  }
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_operands(s);
}

// O[64 rows][HEAD_SIZE] += P V over the tile's keys (16 per step: two 8-row groups of every
// panel). v_desc: the tile's first key.
template <class Tr, typename T>
__device__ __forceinline__ void sm90_pv(const uint32_t (&pa)[1][Tr::kBlockN / 16][4],
                                        uint64_t v_desc, float (&o)[Tr::kOTiles * 4]) {
  wgmma::fence_operands(o);
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
    wgmma::Wgmma<T, Tr::kHeadSize>::rs(o, pa[0][kk],
                                       wgmma::desc_add(v_desc, kk * 16 * wgmma::kPanelRowBytes));
  }
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_operands(o);
}

template <typename T, int HEAD_SIZE, class Shape>
__global__ void __launch_bounds__(Shape::kWarpGroups * 4 * kWarpSize, Shape::kMinBlocksPerSm)
    paged_prefill_sm90_kernel(const __grid_constant__ AttnArgs a) {
  using Tr = PrefillSm90Tile<T, HEAD_SIZE, Shape>;
  extern __shared__ __align__(16) unsigned char smem_base[];
  const uint32_t misalign = attn::smem_addr(smem_base) % wgmma::kSwizzleAtomBytes;
  unsigned char* smem =
      smem_base + (misalign == 0 ? 0 : wgmma::kSwizzleAtomBytes - misalign);
  T* q_smem = reinterpret_cast<T*>(smem);  // [panels][kBlockM][64], swizzled
  // Stage st: K tile at kv_smem + 2 st * kKvTileBytes, V tile after it ([panels][kBlockN][64]).
  unsigned char* kv_smem = smem + Tr::kQBytes;

  WorkTile w;
  int kv_head;
  if (!locate_prefill_tile<Tr>(a, w, kv_head)) return;
  auto k_dst = [&](int stage) { return kv_smem + 2 * stage * Tr::kKvTileBytes; };
  auto v_dst = [&](int stage) { return kv_smem + (2 * stage + 1) * Tr::kKvTileBytes; };
  load_prefill_q<Tr>(a, w, kv_head, q_smem);
#pragma unroll
  for (int st = 0; st < Tr::kStages - 1; ++st) {
    if (w.tile_begin + st < w.tile_end) {
      load_prefill_kv<Tr, T>(a, w, kv_head, w.tile_begin + st, k_dst(st), v_dst(st));
    }
    attn::cp_async_commit();
  }

  const int warp = threadIdx.x / kWarpSize;
  const int group = warp / 4;
  const int G = a.group_size;
  const int group_row0 = w.row0 + group * 64;
  const bool group_active = group_row0 < w.num_rows;  // warpgroup-uniform, as wgmma needs
  const KeySpan ks = key_span(a.p, w.first_pos, w.seq_len, group_row0 / G,
                              (min(group_row0 + 64, w.num_rows) - 1) / G);
  const ScoreMap sm = make_score_map<Tr>(a.p);
  const bool map_first = sm.soft_cap || !(sm.mul > 0.f);
  const float score_mul = map_first ? 1.f : sm.mul;
  constexpr uint32_t kSbo = wgmma::kSwizzleAtomBytes;
  const uint64_t q_desc = wgmma::make_desc(
      reinterpret_cast<unsigned char*>(q_smem) + group * 64 * wgmma::kPanelRowBytes, 16, kSbo);
  float o[1][Tr::kOTiles][4] = {};
  float m[1][2] = {{-INFINITY, -INFINITY}};
  float l[1][2] = {{0.f, 0.f}};

  int stage = 0;
  for (int tile = w.tile_begin; tile < w.tile_end; ++tile) {
    attn::cp_async_wait<Tr::kStages - 2>();
    wgmma::fence_view_async_shared();  // this thread's copies, visible to wgmma
    __syncthreads();
    const int next = tile + Tr::kStages - 1;
    const int next_stage = stage == 0 ? Tr::kStages - 1 : stage - 1;
    if (next < w.tile_end) {
      load_prefill_kv<Tr, T>(a, w, kv_head, next, k_dst(next_stage), v_dst(next_stage));
    }
    attn::cp_async_commit();
    const int k0 = w.kv_lo + tile * Tr::kBlockN;
    if (group_active && k0 < ks.hi && k0 + Tr::kBlockN > ks.lo) {
      float s[1][Tr::kSTiles][4];
      sm90_scores<Tr, T>(q_desc, wgmma::make_desc(k_dst(stage), 16, kSbo),
                         reinterpret_cast<float(&)[Tr::kSTiles * 4]>(s));
      if (map_first) {
#pragma unroll
        for (int j = 0; j < Tr::kSTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float x = s[0][j][e] * sm.mul;
            s[0][j][e] = sm.soft_cap ? tanhf(x) * sm.cap_log2 : x;
          }
        }
      }
      if (k0 + Tr::kBlockN > ks.min_hi || k0 < ks.max_lo) {
        mask_scores<Tr>(a, w, w.row0 + warp * Tr::kWarpRows, k0, s);
      }
      uint32_t pa[1][Tr::kBlockN / 16][4];
      prefill_softmax<Tr, T>(s, o, m, l, score_mul, pa);
      sm90_pv<Tr, T>(pa, wgmma::make_desc(v_dst(stage), Tr::kBlockN * wgmma::kPanelRowBytes, kSbo),
                     reinterpret_cast<float(&)[Tr::kOTiles * 4]>(o));
    }
    stage = stage + 1 == Tr::kStages ? 0 : stage + 1;
  }
  attn::cp_async_wait<0>();
  if (group_active) {
    store_prefill_rows<Tr, T>(a, w, kv_head, w.row0 + warp * Tr::kWarpRows, o, m, l, sm.v_scale);
  }
}

}  // namespace pyorch::kernels
