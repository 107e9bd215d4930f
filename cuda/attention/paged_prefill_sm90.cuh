// The Hopper (sm_90a) variant of paged_prefill_kernel: the same work decomposition, paged loads,
// masks, online softmax and epilogue (paged_prefill.cuh), with the two products on warpgroup MMA
// (wgmma.cuh). Each consumer warpgroup owns 64 query rows: S = Q K^T reads Q and K straight from
// 128-byte-swizzled shared memory, P V takes P from registers (the S accumulator layout is the
// A-fragment layout, so P never touches shared memory) and V from shared memory with the
// transpose bit. K/V tiles of kBlockN keys arrive by cp.async through the block table (a cache
// block holds 16 tokens: a TMA box per block would not pay at that size).
//
// Warp specialization (FlashAttention-3's scheme, our code): warpgroup 0 is the producer, which
// keeps only a few registers (setmaxnreg) and streams Q and the K/V tiles through a kStages ring;
// a stage's `full` mbarrier completes when its copies have landed (each producer thread waits for
// its own cp.async group, fences them to the async proxy and arrives), its `empty` mbarrier when
// every consumer warp's wgmma's that read it have completed. The consumer warpgroups take the
// freed registers and pipeline within the warpgroup: the softmax of tile j runs while the tensor
// cores compute P V of tile j - 1, issued together with Q K^T of tile j.
//
// Head sizes 64, 128 and 256 (whole 64-element panels) with fp16/bf16 caches take this kernel;
// head sizes 80/96 and fp8 caches stay on the mma.sync kernel (attention.cu routes them).
#pragma once

#include <cstdint>

#include "attention/paged_prefill.cuh"
#include "attention/wgmma.cuh"

namespace pyorch::kernels {

constexpr int kWarpGroupThreads = 4 * kWarpSize;

// CTA shape: {consumer warpgroups of 64 rows, keys per KV tile, stages}, one CTA per SM (384
// threads), the producer at kProducerRegs registers, each consumer thread at kConsumerRegs
// (56 * 128 + 224 * 256 <= 64K; no spills). The pipeline keeps a tile's stage until P V of it
// has run beside Q K^T of the next tile, so it needs 3 stages to load ahead.
// NOTE(prefill): H100, bf16, head 128, 32/8 heads, causal, TFLOP/s at 4k / 8k / 4 x 2k (direct
// launch), one run: this shape {2, 64, 4} 376 / 430 / 311; {2, 128, 3} 364 / 435 / 296 (20-byte
// producer spill); {2, 64, 3} 352 / 394 / 293; {2, 128, 2} 279 / 311 / 246 (the load of tile j + 1
// waits for P V of tile j - 1); torch SDPA flash 270 / 321 / 285. Before warp specialization
// (every thread loading, no overlap inside a warpgroup, 2 CTAs per SM): {2, 64, 2} 358 / 394 / 322
// (128 registers, ptxas spilled 24 bytes and serialized the wgmma's); earlier: {2, 128, 2, 1 CTA}
// 338 / 373; {1, 64, 2, 2 CTAs} 309 / 337; the mma.sync kernel 303 / 329. At 4 x 2k the one CTA
// per SM exposes each CTA's prologue (Q and the first tile) and tail: a persistent grid is next.
template <int HEAD_SIZE>
struct PrefillSm90Shape {
  static constexpr int kConsumerGroups = 2;
  static constexpr int kBlockN = 64;
  static constexpr int kStages = HEAD_SIZE <= 128 ? 4 : 2;
  // Head 256 (128 fp32 O registers per thread) has no room for the scores of a second tile: its
  // consumers run Q K^T, softmax, P V in turn (the other warpgroup overlaps them).
  static constexpr bool kOverlap = HEAD_SIZE <= 128;
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
};

template <typename T, int HEAD_SIZE, class Shape>
struct PrefillSm90Tile {
  static constexpr bool kFp8 = false;
  static constexpr int kHeadSize = HEAD_SIZE;
  static constexpr int kConsumerGroups = Shape::kConsumerGroups;
  static constexpr int kConsumerWarps = 4 * kConsumerGroups;
  static constexpr int kThreads = kWarpGroupThreads * (kConsumerGroups + 1);
  static constexpr int kLoadThreads = kWarpGroupThreads;  // the producer warpgroup
  static constexpr int kMTiles = 1;  // per warp: the 16 rows of its share of the m64 wgmma
  static constexpr int kWarpRows = 16;
  static constexpr int kBlockM = 64 * kConsumerGroups;
  static constexpr int kBlockN = Shape::kBlockN;
  static constexpr int kStages = Shape::kStages;
  static constexpr bool kOverlap = Shape::kOverlap;
  static constexpr int kChunkElems = 16 / sizeof(T);
  static constexpr int kCacheChunkElems = kChunkElems;
  static constexpr int kSTiles = kBlockN / 8;
  static constexpr int kOTiles = HEAD_SIZE / 8;
  static constexpr int kQBytes = kBlockM * HEAD_SIZE * static_cast<int>(sizeof(T));
  static constexpr int kKvTileBytes = kBlockN * HEAD_SIZE * static_cast<int>(sizeof(T));
  static constexpr int kBarrierBytes = 2 * kStages * static_cast<int>(sizeof(uint64_t));
  // + one swizzle atom: the dynamic shared memory base is only 16-byte aligned.
  static constexpr size_t kSmemBytes =
      wgmma::kSwizzleAtomBytes + kQBytes + 2 * kStages * kKvTileBytes + kBarrierBytes;

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
  static_assert(kSmemBytes <= 227 * 1024, "fits Hopper shared memory");
  static_assert(Shape::kProducerRegs * kWarpGroupThreads +
                        Shape::kConsumerRegs * kWarpGroupThreads * kConsumerGroups <=
                    64 * 1024,
                "the register file holds both roles");
};

// Issues S[64 rows][kBlockN keys] = Q K^T (unscaled) of this warpgroup as one wgmma group.
// q_desc/k_desc: descriptors of the warpgroup's first Q row and of the tile's first key (panel 0,
// chunk 0). 16 head dims per step: 32 bytes along a panel row, then the next panel.
template <class Tr, typename T>
__device__ __forceinline__ void sm90_scores_issue(uint64_t q_desc, uint64_t k_desc,
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
}

// Issues O[64 rows][HEAD_SIZE] += P V over the tile's keys as one wgmma group (16 keys per step:
// two 8-row groups of every panel). v_desc: the tile's first key. o and pa stay in use until the
// group is waited for.
template <class Tr, typename T>
__device__ __forceinline__ void sm90_pv_issue(const uint32_t (&pa)[1][Tr::kBlockN / 16][4],
                                              uint64_t v_desc, float (&o)[Tr::kOTiles * 4]) {
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
    wgmma::Wgmma<T, Tr::kHeadSize>::rs(o, pa[0][kk],
                                       wgmma::desc_add(v_desc, kk * 16 * wgmma::kPanelRowBytes));
  }
  wgmma::commit();
}

// The producer warpgroup: Q with the first tile, then every KV tile of [tile_begin, tile_end)
// into stage i % kStages once the consumers have freed it. A tile's full barrier is signalled
// once the next tile's copies are in flight, so one tile is always on its way; but never later
// than before blocking on an empty barrier: the consumers free tile i - 1 only after they got
// tile i (P V of a tile runs beside Q K^T of the next), so with two stages, waiting to load tile
// i + 1 before signalling tile i would deadlock.
template <class Tr, typename T>
__device__ __forceinline__ void sm90_produce(const AttnArgs& a, const WorkTile& w, int kv_head,
                                             T* q_smem, unsigned char* kv_smem, uint64_t* full,
                                             uint64_t* empty) {
  const int tid = threadIdx.x;
  const int num_tiles = w.tile_end - w.tile_begin;
  int signalled = 0;  // tiles [0, signalled) have had their full barrier arrived on
  for (int i = 0; i < num_tiles; ++i) {
    const int stage = i % Tr::kStages;
    if (i >= Tr::kStages) {
      if (signalled < i) {
        attn::cp_async_wait<0>();
        wgmma::fence_view_async_shared();
        wgmma::mbarrier_arrive(&full[(i - 1) % Tr::kStages]);
        signalled = i;
      }
      wgmma::mbarrier_wait(&empty[stage], (i / Tr::kStages - 1) & 1);
    }
    if (i == 0) load_prefill_q<Tr>(a, w, kv_head, q_smem, tid);
    unsigned char* k_dst = kv_smem + 2 * stage * Tr::kKvTileBytes;
    load_prefill_kv<Tr, T>(a, w, kv_head, w.tile_begin + i, k_dst, k_dst + Tr::kKvTileBytes, tid);
    attn::cp_async_commit();
    if (i > 0 && signalled < i) {
      attn::cp_async_wait<1>();          // tile i - 1 landed (this thread's copies)
      wgmma::fence_view_async_shared();  // ... and is visible to wgmma
      wgmma::mbarrier_arrive(&full[(i - 1) % Tr::kStages]);
      signalled = i;
    }
  }
  if (signalled < num_tiles) {
    attn::cp_async_wait<0>();
    wgmma::fence_view_async_shared();
    wgmma::mbarrier_arrive(&full[(num_tiles - 1) % Tr::kStages]);
  }
}

// A consumer warpgroup (group: 0..kConsumerGroups - 1) over its 64 rows. Every warp waits for and
// frees every tile of the ring, computing only the tiles [first, last) its rows can see.
template <class Tr, typename T>
__device__ __forceinline__ void sm90_consume(const AttnArgs& a, const WorkTile& w, int kv_head,
                                             const T* q_smem, const unsigned char* kv_smem,
                                             uint64_t* full, uint64_t* empty) {
  constexpr int kN = Tr::kBlockN;
  constexpr uint32_t kSbo = wgmma::kSwizzleAtomBytes;
  const int tid = threadIdx.x - kWarpGroupThreads;
  const int group = tid / kWarpGroupThreads;
  const int lane = tid % kWarpSize;
  const int warp_row0 = w.row0 + (tid / kWarpSize) * Tr::kWarpRows;
  const int G = a.group_size;
  const int group_row0 = w.row0 + group * 64;
  const bool group_active = group_row0 < w.num_rows;  // warpgroup-uniform, as wgmma needs
  KeySpan ks = {0, 0, 0, 0};
  int first = w.tile_begin, last = w.tile_begin;
  if (group_active) {
    ks = key_span(a.p, w.first_pos, w.seq_len, group_row0 / G,
                  (min(group_row0 + 64, w.num_rows) - 1) / G);
    first = max(w.tile_begin, (ks.lo - w.kv_lo) / kN);
    last = max(first, min(w.tile_end, (ks.hi - w.kv_lo + kN - 1) / kN));
  }
  const ScoreMap sm = make_score_map<Tr>(a.p);
  const bool map_first = sm.soft_cap || !(sm.mul > 0.f);
  const float score_mul = map_first ? 1.f : sm.mul;
  const uint64_t q_desc = wgmma::make_desc(
      reinterpret_cast<const unsigned char*>(q_smem) + group * 64 * wgmma::kPanelRowBytes, 16,
      kSbo);
  auto stage_of = [&](int tile) { return (tile - w.tile_begin) % Tr::kStages; };
  auto k_desc = [&](int tile) {
    return wgmma::make_desc(kv_smem + 2 * stage_of(tile) * Tr::kKvTileBytes, 16, kSbo);
  };
  auto v_desc = [&](int tile) {
    return wgmma::make_desc(kv_smem + (2 * stage_of(tile) + 1) * Tr::kKvTileBytes,
                            kN * wgmma::kPanelRowBytes, kSbo);
  };
  auto wait_full = [&](int tile) {
    wgmma::mbarrier_wait(&full[stage_of(tile)], ((tile - w.tile_begin) / Tr::kStages) & 1);
  };
  auto release = [&](int tile) {  // after this warp's wgmma's on the tile completed
    if (lane == 0) wgmma::mbarrier_arrive(&empty[stage_of(tile)]);
  };

  float o[1][Tr::kOTiles][4] = {};
  float m[1][2] = {{-INFINITY, -INFINITY}};
  float l[1][2] = {{0.f, 0.f}};
  auto o_flat = [&]() -> float(&)[Tr::kOTiles * 4] {
    return reinterpret_cast<float(&)[Tr::kOTiles * 4]>(o);
  };
  // Scores of `tile` -> probabilities (packed A fragments), with the rows' rescale factors.
  auto probs = [&](int tile, float (&s)[1][Tr::kSTiles][4], float (&alpha)[1][2],
                   uint32_t (&pa)[1][kN / 16][4]) {
    const int k0 = w.kv_lo + tile * kN;
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
    if (k0 + kN > ks.min_hi || k0 < ks.max_lo) mask_scores<Tr>(a, w, warp_row0, k0, s);
    prefill_probs<Tr, T>(s, m, l, score_mul, alpha, pa);
  };

  for (int tile = w.tile_begin; tile < first; ++tile) {
    wait_full(tile);
    release(tile);
  }
  // One step of the pipeline: Q K^T of `tile` and P V of the tile before it (probabilities in
  // pa_prev) in flight together, the softmax of `tile` into pa under the P V. The loop below
  // alternates two pa arrays instead of copying pa back: ptxas serializes the wgmma's when the
  // registers an in-flight wgmma reads are redefined, which a copy's coalescing would do.
  using Probs = uint32_t[1][kN / 16][4];
  auto step = [&](int tile, Probs& pa_prev, Probs& pa) {
    wait_full(tile);
    wgmma::fence_operands(o_flat());  // the last rescale lands before the wgmma fence
    float s[1][Tr::kSTiles][4];
    auto& s_flat = reinterpret_cast<float(&)[Tr::kSTiles * 4]>(s);
    sm90_scores_issue<Tr, T>(q_desc, k_desc(tile), s_flat);
    sm90_pv_issue<Tr, T>(pa_prev, v_desc(tile - 1), o_flat());
    wgmma::wait<1>();  // the scores; P V of the previous tile runs under the softmax
    wgmma::fence_operands(s_flat);
    float alpha[1][2];
    probs(tile, s, alpha, pa);
    wgmma::wait<0>();
    wgmma::fence_operands(o_flat());
    release(tile - 1);
    prefill_rescale<Tr>(o, alpha);
  };
  // Q K^T of `tile` alone, then its softmax.
  auto scores_probs = [&](int tile, float (&alpha)[1][2], Probs& pa) {
    wait_full(tile);
    float s[1][Tr::kSTiles][4];
    auto& s_flat = reinterpret_cast<float(&)[Tr::kSTiles * 4]>(s);
    sm90_scores_issue<Tr, T>(q_desc, k_desc(tile), s_flat);
    wgmma::wait<0>();
    wgmma::fence_operands(s_flat);
    probs(tile, s, alpha, pa);
  };
  // The last P V, of the probabilities in pa (of tile last - 1).
  auto finish = [&](Probs& pa) {
    wgmma::fence_operands(o_flat());
    sm90_pv_issue<Tr, T>(pa, v_desc(last - 1), o_flat());
    wgmma::wait<0>();
    wgmma::fence_operands(o_flat());
    release(last - 1);
  };
  if constexpr (!Tr::kOverlap) {
    for (int tile = first; tile < last; ++tile) {
      float alpha[1][2];
      Probs pa;
      scores_probs(tile, alpha, pa);
      prefill_rescale<Tr>(o, alpha);
      wgmma::fence_operands(o_flat());
      sm90_pv_issue<Tr, T>(pa, v_desc(tile), o_flat());
      wgmma::wait<0>();
      wgmma::fence_operands(o_flat());
      release(tile);
    }
  } else if (first < last) {
    Probs pa0, pa1;
    float alpha[1][2];  // o is still zero
    scores_probs(first, alpha, pa0);
    int tile = first + 1;
    for (; tile + 1 < last; tile += 2) {
      step(tile, pa0, pa1);
      step(tile + 1, pa1, pa0);
    }
    if (tile < last) {
      step(tile, pa0, pa1);
      finish(pa1);
    } else {
      finish(pa0);
    }
  }
  for (int tile = last; tile < w.tile_end; ++tile) {
    wait_full(tile);
    release(tile);
  }
  if (group_active) {
    store_prefill_rows<Tr, T>(a, w, kv_head, warp_row0, o, m, l, sm.v_scale);
  }
}

template <typename T, int HEAD_SIZE, class Shape>
__global__ void __launch_bounds__((Shape::kConsumerGroups + 1) * kWarpGroupThreads, 1)
    paged_prefill_sm90_kernel(const __grid_constant__ AttnArgs a) {
  using Tr = PrefillSm90Tile<T, HEAD_SIZE, Shape>;
  extern __shared__ __align__(16) unsigned char smem_base[];
  const uint32_t misalign = attn::smem_addr(smem_base) % wgmma::kSwizzleAtomBytes;
  unsigned char* smem =
      smem_base + (misalign == 0 ? 0 : wgmma::kSwizzleAtomBytes - misalign);
  T* q_smem = reinterpret_cast<T*>(smem);  // [panels][kBlockM][64], swizzled
  // Stage st: K tile at kv_smem + 2 st * kKvTileBytes, V tile after it ([panels][kBlockN][64]).
  unsigned char* kv_smem = smem + Tr::kQBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(kv_smem + 2 * Tr::kStages * Tr::kKvTileBytes);
  uint64_t* empty = full + Tr::kStages;  // [kStages] each

  WorkTile w;
  int kv_head;
  if (!locate_prefill_tile<Tr>(a, w, kv_head)) return;  // CTA-uniform
  if (threadIdx.x == 0) {
    for (int st = 0; st < Tr::kStages; ++st) {
      wgmma::mbarrier_init(&full[st], Tr::kLoadThreads);
      wgmma::mbarrier_init(&empty[st], Tr::kConsumerWarps);
    }
  }
  __syncthreads();
  if (threadIdx.x < kWarpGroupThreads) {
    wgmma::setmaxnreg_dec<Shape::kProducerRegs>();
    sm90_produce<Tr, T>(a, w, kv_head, q_smem, kv_smem, full, empty);
  } else {
    wgmma::setmaxnreg_inc<Shape::kConsumerRegs>();
    sm90_consume<Tr, T>(a, w, kv_head, q_smem, kv_smem, full, empty);
  }
}

}  // namespace pyorch::kernels
