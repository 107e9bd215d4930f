// The Hopper (sm_90a) variant of paged_prefill_kernel: the same work items, paged loads, masks,
// online softmax and epilogue (paged_prefill.cuh), with the two products on warpgroup MMA
// (wgmma.cuh). Each consumer warpgroup owns 64 query rows: S = Q K^T reads Q and K straight from
// 128-byte-swizzled shared memory, P V takes P from registers (the S accumulator layout is the
// A-fragment layout, so P never touches shared memory) and V from shared memory with the
// transpose bit. K/V tiles of kBlockN keys arrive by cp.async through the block table (a cache
// block holds 16 tokens: a TMA box per block would not pay at that size).
//
// Warp specialization (FlashAttention-3's scheme, our code): warpgroup 0 is the producer, which
// keeps only a few registers (setmaxnreg) and streams Q and the K/V tiles through a kStages ring;
// a stage's `full` mbarrier completes when the producer threads' copies have landed
// (cp.async.mbarrier.arrive, so the producer never waits for its own copies), its `empty`
// mbarrier when every consumer warp's wgmma's that read it have completed. The consumer
// warpgroups take the freed registers, and
//  - issue Q K^T of tile j with P V of tile j - 1 (Sm90Schedule; Q in registers where they fit);
//  - ping-pong between the two (kPingPong): a warpgroup issues its products only in its turn,
//    handed over by named barriers, so that one warpgroup's softmax runs under the other's
//    products instead of both contending for the tensor cores and then both idling them;
//  - persistence (kPersistent): one CTA per SM; producer thread 0 draws the (row tile, kv head)
//    work items from a per-split counter (items come longest first within a sequence, and the
//    CTA that finishes first takes the next), locates them and hands them to the consumers with
//    their Q buffer (double-buffered where it fits), so the next item's Q and first tiles load
//    under this item's tail and its output stores.
//
// Head sizes 64, 128, 192 and 256 (whole 64-element panels) with fp16/bf16 caches take this
// kernel; other head sizes and fp8 caches stay on the mma.sync kernel (attention.cu routes them).
#pragma once

#include <cstdint>

#include "attention/paged_prefill.cuh"
#include "attention/wgmma.cuh"

namespace pyorch::kernels {

constexpr int kWarpGroupThreads = 4 * kWarpSize;
constexpr int kSchedBarrier = 1;     // named barriers 1, 2: consumer group 0's, 1's turn
constexpr int kProducerBarrier = 3;  // the producer warpgroup's own

// CTA shape: 2 consumer warpgroups of 64 rows, BLOCK_N keys per KV tile, STAGES ring stages, one
// CTA per SM (384 threads), the producer at kProducerRegs registers, each consumer thread at
// kConsumerRegs (56 * 128 + 224 * 256 <= 64K).
// NOTE(prefill): H100, bf16, head 128, 32/8 heads, causal, TFLOP/s at 4k / 8k / 4 x 2k (direct
// launch), before ping-pong and persistence, one run: {64 keys, 4 stages} 376 / 430 / 311;
// {128, 3} 364 / 435 / 296 (20-byte producer spill); {64, 3} 352 / 394 / 293; {128, 2} 279 / 311 /
// 246; torch SDPA flash 270 / 321 / 285. Before warp specialization (every thread loading, 2 CTAs
// per SM): {64, 2} 358 / 394 / 322.
// How a consumer warpgroup orders its products and softmax over the tiles:
//  kOverlap: Q K^T of tile j and P V of tile j - 1 in one turn, the softmax of j under the P V
//    (two tiles' probabilities live at once);
//  kFused: the same turn, both waited for before the softmax (one probability array);
//  kSequential: Q K^T of j in one turn, its softmax, P V of j in the next; a stage is freed one
//    tile earlier than in the two others, which a 2-stage ring needs to load a tile ahead.
enum class Sm90Schedule { kOverlap, kFused, kSequential };

template <int HEAD_SIZE, int BLOCK_N = 64, int STAGES = (HEAD_SIZE <= 128 ? 4 : 2),
          Sm90Schedule SCHEDULE =
              (HEAD_SIZE <= 128 ? Sm90Schedule::kOverlap : Sm90Schedule::kSequential),
          bool PINGPONG = true, bool PERSISTENT = true, bool Q_IN_REGS = false>
struct PrefillSm90Shape {
  static constexpr int kConsumerGroups = 2;
  static constexpr int kBlockN = BLOCK_N;
  static constexpr int kStages = STAGES;
  static constexpr Sm90Schedule kSchedule = SCHEDULE;
  static constexpr bool kPingPong = PINGPONG;
  static constexpr bool kPersistent = PERSISTENT;
  // Q K^T takes Q from registers (loaded once per item; the Q buffer is free right away) instead
  // of shared memory: less shared-memory traffic per product, HEAD_SIZE / 4 more registers.
  static constexpr bool kQInRegs = Q_IN_REGS;
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
};

// A work item as the producer found it (locate_prefill_tile), handed to the consumers in shared
// memory with its Q buffer; valid == 0: no more items.
struct Sm90Item {
  WorkTile w;
  int kv_head;
  int valid;
};

// The shape attention.cu launches per head size.
// NOTE(prefill): H100, bf16, 32/8 heads, causal, TFLOP/s at 4k / 8k / 4 x 2k (direct launch), two
// device runs, 2026-11-24. First run, persistent with a fixed snake order over the CTAs: head 128
// {128 keys, 3 stages, fused, Q in registers} 451 / 523 / 318; {64, 4, overlap, Q in registers}
// 427 / 489 / 303; {64, 4, overlap} 414 / 472 / 291, without ping-pong 400 / 457 / 281, not
// persistent 397 / 481 / 321; {64, 4, fused} 395 / 439 / 279; {64, 3, overlap} 394 / 439 / 278;
// {128, 2, *} 222-357. The snake order left 4 x 2k 20% unbalanced (simulated). Second run, CTAs
// drawing items from a counter: head 128 this shape 443 / 518 / 380 (repeat 436 / 514 / 367), not
// persistent 402 / 490 / 315, without ping-pong 442 / 518 / 371, Q from shared memory 434 / 516 /
// 356, {64, 4, overlap, Q in registers} 413 / 480 / 352, sequential 410 / 466 / 360; head 64 this
// shape 326 / 381 / 283, with overlap 313 / 377 / 274; head 256 this shape 454 / 509 / 393 (repeat
// 454 / 508 / 359), without ping-pong 457 / 516 / 359, not persistent 433 / 496 / 343, fused (a
// stage held one tile longer) 332 / 366 / 315, {32, 4} 367 / 404 / 313. torch SDPA flash, head
// 64 / 128 / 256: 221 / 271 / 220, 264 / 314 / 275, 282 / 309 / 290.
// NOTE(prefill): kOverlap does not overlap as written: ptxas places the wait for P V right after
// the wait for the scores (WARPGROUP.DEPBAR.LE 1 then .LE 0 back to back in the SASS, also in the
// kernel before this one), so the softmax runs after both products. Keeping pa's registers live
// across the wait (a read-write asm operand, a LOP3 with an opaque zero) did not move it; the
// cause is not found. Ping-pong (the other warpgroup's products under this one's softmax) is the
// overlap that works, and the hardware interleaves the two warpgroups about as well without the
// named barriers (head 128: equal within noise).
template <int HEAD_SIZE>
struct PrefillSm90Default;
template <>
struct PrefillSm90Default<64> {
  using type = PrefillSm90Shape<64, 128, 4, Sm90Schedule::kFused, true, true, true>;
};
template <>
struct PrefillSm90Default<128> {
  using type = PrefillSm90Shape<128, 128, 3, Sm90Schedule::kFused, true, true, true>;
};
template <>
struct PrefillSm90Default<256> {
  using type = PrefillSm90Shape<256, 64, 2, Sm90Schedule::kSequential, true, true, false>;
};
template <>
struct PrefillSm90Default<192> {  // NOTE(prefill): head 256's shape, not measured for 192
  using type = PrefillSm90Shape<192, 64, 2, Sm90Schedule::kSequential, true, true, false>;
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
  static constexpr Sm90Schedule kSchedule = Shape::kSchedule;
  static constexpr bool kPingPong = Shape::kPingPong;
  static constexpr bool kPersistent = Shape::kPersistent;
  static constexpr bool kQInRegs = Shape::kQInRegs;
  static constexpr int kChunkElems = 16 / sizeof(T);
  static constexpr int kCacheChunkElems = kChunkElems;
  static constexpr int kCopyBytes = 16;  // whole panels: no padded dims, no 8-byte copies
  static constexpr int kSTiles = kBlockN / 8;
  static constexpr int kOTiles = HEAD_SIZE / 8;
  static constexpr int kQBytes = kBlockM * HEAD_SIZE * static_cast<int>(sizeof(T));
  static constexpr int kKvTileBytes = kBlockN * HEAD_SIZE * static_cast<int>(sizeof(T));
  static constexpr int kRingBytes = 2 * kStages * kKvTileBytes;
  static constexpr int kMaxSmemBytes = 227 * 1024;
  // + one swizzle atom: the dynamic shared memory base is only 16-byte aligned.
  static constexpr int kFixedBytes = wgmma::kSwizzleAtomBytes + kRingBytes + 512;
  // Two Q buffers where they fit beside the ring (a persistent CTA loads the next item's Q early).
  static constexpr int kQBuffers =
      kPersistent && !kQInRegs && kFixedBytes + 2 * kQBytes <= kMaxSmemBytes ? 2 : 1;
  // full/empty per stage, q_full/q_empty per Q buffer; then the work item of each Q buffer and
  // the producer's two staging slots (Sm90Item).
  static constexpr int kBarrierBytes =
      (2 * kStages + 2 * kQBuffers) * static_cast<int>(sizeof(uint64_t));
  static constexpr int kItemBytes = (kQBuffers + 2) * static_cast<int>(sizeof(Sm90Item));
  static constexpr size_t kSmemBytes =
      wgmma::kSwizzleAtomBytes + kQBuffers * kQBytes + kRingBytes + kBarrierBytes + kItemBytes;

  static __device__ __forceinline__ int q_chunk_offset(int row, int col) {
    return wgmma::swizzled_chunk_offset(row, col, kBlockM);
  }
  static __device__ __forceinline__ int kv_chunk_offset(int key, int col) {
    return wgmma::swizzled_chunk_offset(key, col, kBlockN);
  }

  static_assert(sizeof(T) == 2, "wgmma takes fp16/bf16 here");
  static_assert(HEAD_SIZE % wgmma::kPanelElems == 0, "whole 64-element panels");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256 && HEAD_SIZE <= 256, "wgmma n <= 256");
  static_assert(kConsumerGroups == 2, "the ping-pong hands turns between two warpgroups");
  static_assert(kStages >= 2, "the ring needs a stage to compute and one to fill");
  static_assert(kSmemBytes <= kMaxSmemBytes, "fits Hopper shared memory");
  static_assert(Shape::kProducerRegs * kWarpGroupThreads +
                        Shape::kConsumerRegs * kWarpGroupThreads * kConsumerGroups <=
                    64 * 1024,
                "the register file holds both roles");
};

// The CTA's pipeline barriers (shared memory) and how far it has got through them: tiles and Q
// loads that went through the ring so far (the same counts in the producer and the consumers).
struct Sm90Pipe {
  uint64_t* full;     // [kStages] the stage's K/V tile landed (one arrival per producer thread)
  uint64_t* empty;    // [kStages] the consumers are done with it (one arrival per consumer warp)
  uint64_t* q_full;   // [kQBuffers] the buffer's Q rows landed
  uint64_t* q_empty;  // [kQBuffers] the consumers' last Q K^T on it completed
  int tiles;
  int qs;
};

// The CTA's k-th work item (grid.x index of the non-persistent launch): snake order, so that the
// CTAs that draw the longer item of one round draw the shorter one of the next.
template <class Tr>
__device__ __forceinline__ int64_t sm90_item(int k) {
  if constexpr (!Tr::kPersistent) return k == 0 ? blockIdx.x : INT64_MAX;
  const int64_t c = (k & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  return static_cast<int64_t>(k) * gridDim.x + c;
}

// Issues S[64 rows][kBlockN keys] = Q K^T (unscaled) of this warpgroup as one wgmma group.
// q_desc/k_desc: descriptors of the warpgroup's first Q row and of the tile's first key (panel 0,
// chunk 0). 16 head dims per step: 32 bytes along a panel row, then the next panel.
template <class Tr, typename T>
__device__ __forceinline__ void sm90_scores_issue(uint64_t q_desc, uint64_t k_desc,
                                                  float (&s)[Tr::kSTiles * 4]) {
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

// The same with Q from registers: qa[kk] is the A fragment of head dims [16 kk, 16 kk + 16).
template <class Tr, typename T>
__device__ __forceinline__ void sm90_scores_issue(const uint32_t (&qa)[Tr::kOTiles / 2][4],
                                                  uint64_t k_desc, float (&s)[Tr::kSTiles * 4]) {
#pragma unroll
  for (int kk = 0; kk < Tr::kOTiles / 2; ++kk) {
    const uint32_t k_off = (kk / 4) * Tr::kBlockN * wgmma::kPanelRowBytes + (kk % 4) * 32;
    wgmma::Wgmma<T, Tr::kBlockN>::rs_k(s, qa[kk], wgmma::desc_add(k_desc, k_off), kk > 0 ? 1 : 0);
  }
  wgmma::commit();
}

// Loads this warp's 16 Q rows (rows 16 w .. of warpgroup `group`) from the swizzled Q buffer as
// wgmma A fragments: ldmatrix matrices (rows 0-7, 8-15) x (dims 0-7, 8-15) of each 16-dim step.
template <class Tr>
__device__ __forceinline__ void sm90_load_q_frags(const unsigned char* q_buf, int warp_in_cta,
                                                  uint32_t (&qa)[Tr::kOTiles / 2][4]) {
  const int lane = threadIdx.x % kWarpSize;
  const int row = warp_in_cta * 16 + lane % 16;
#pragma unroll
  for (int kk = 0; kk < Tr::kOTiles / 2; ++kk) {
    attn::ldmatrix_x4(qa[kk], q_buf + Tr::q_chunk_offset(row, 2 * kk + lane / 16));
  }
}

// o *= alpha, skipped when no row of the warp changed its maximum (alpha is exactly 1 then):
// once the running maxima settle, most tiles need no rescale.
template <class Tr>
__device__ __forceinline__ void sm90_rescale(float (&o)[1][Tr::kOTiles][4],
                                             const float (&alpha)[1][2]) {
  if (__all_sync(0xffffffffu, alpha[0][0] == 1.f && alpha[0][1] == 1.f)) return;
  prefill_rescale<Tr>(o, alpha);
}

// Issues O[64 rows][HEAD_SIZE] += P V over the tile's keys as one wgmma group (16 keys per step:
// two 8-row groups of every panel). v_desc: the tile's first key. o and pa stay in use until the
// group is waited for.
template <class Tr, typename T>
__device__ __forceinline__ void sm90_pv_issue(const uint32_t (&pa)[1][Tr::kBlockN / 16][4],
                                              uint64_t v_desc, float (&o)[Tr::kOTiles * 4]) {
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
    wgmma::Wgmma<T, Tr::kHeadSize>::rs(o, pa[0][kk],
                                       wgmma::desc_add(v_desc, kk * 16 * wgmma::kPanelRowBytes));
  }
  wgmma::commit();
}

// The producer warpgroup's share of one work item: its Q rows into the next Q buffer (whose item
// slot thread 0 has filled), then every
// KV tile of [tile_begin, tile_end) into the ring once the consumers freed the stage. Each
// thread's copies complete on the barrier by cp.async.mbarrier.arrive, so the producer only ever
// blocks on a free buffer.
template <class Tr, typename T>
__device__ __forceinline__ void sm90_produce(const AttnArgs& a, const WorkTile& w, int kv_head,
                                             unsigned char* q_smem, unsigned char* kv_smem,
                                             const Sm90Pipe& pipe) {
  const int tid = threadIdx.x;
  const int qb = pipe.qs % Tr::kQBuffers;  // free: the caller waited on q_empty
  load_prefill_q<Tr>(a, w, kv_head, reinterpret_cast<T*>(q_smem + qb * Tr::kQBytes), tid);
  wgmma::cp_async_mbarrier_arrive(&pipe.q_full[qb]);
  if (tid == 0) wgmma::mbarrier_arrive(&pipe.q_full[qb]);  // publishes the item slot
  for (int tile = w.tile_begin; tile < w.tile_end; ++tile) {
    const int n = pipe.tiles + tile - w.tile_begin;
    const int stage = n % Tr::kStages;
    if (n >= Tr::kStages) wgmma::mbarrier_wait(&pipe.empty[stage], (n / Tr::kStages - 1) & 1);
    unsigned char* k_dst = kv_smem + 2 * stage * Tr::kKvTileBytes;
    load_prefill_kv<Tr, T>(a, w, kv_head, tile, k_dst, k_dst + Tr::kKvTileBytes, tid);
    wgmma::cp_async_mbarrier_arrive(&pipe.full[stage]);
  }
}

// A consumer warpgroup (group: 0..1) over its 64 rows of one work item. Both warpgroups compute
// every tile of [tile_begin, tile_end) (a tile that some rows cannot see is masked for them), so
// that they take the same number of turns.
template <class Tr, typename T>
__device__ __forceinline__ void sm90_consume(const AttnArgs& a, const WorkTile& w, int kv_head,
                                             const unsigned char* q_smem,
                                             const unsigned char* kv_smem, const Sm90Pipe& pipe) {
  constexpr int kN = Tr::kBlockN;
  constexpr uint32_t kSbo = wgmma::kSwizzleAtomBytes;
  const int tid = threadIdx.x - kWarpGroupThreads;
  const int group = tid / kWarpGroupThreads;
  const int lane = tid % kWarpSize;
  const int warp_row0 = w.row0 + (tid / kWarpSize) * Tr::kWarpRows;
  const int G = a.group_size;
  const int group_row0 = w.row0 + group * 64;
  // The mask test's bounds, over this warpgroup's rows; a warpgroup of padding rows masks all.
  KeySpan ks = {0, 0, 0, 0};
  if (group_row0 < w.num_rows) {
    ks = key_span(a.p, w.first_pos, w.seq_len, group_row0 / G,
                  (min(group_row0 + 64, w.num_rows) - 1) / G);
  }
  const int first = w.tile_begin, last = w.tile_end;
  const ScoreMap sm = make_score_map<Tr>(a.p);
  const bool map_first = sm.soft_cap || !(sm.mul > 0.f);
  const float score_mul = map_first ? 1.f : sm.mul;
  const int qb = pipe.qs % Tr::kQBuffers;
  const uint64_t q_desc =
      wgmma::make_desc(q_smem + qb * Tr::kQBytes + group * 64 * wgmma::kPanelRowBytes, 16, kSbo);
  auto stage_of = [&](int tile) { return (pipe.tiles + tile - first) % Tr::kStages; };
  auto k_desc = [&](int tile) {
    return wgmma::make_desc(kv_smem + 2 * stage_of(tile) * Tr::kKvTileBytes, 16, kSbo);
  };
  auto v_desc = [&](int tile) {
    return wgmma::make_desc(kv_smem + (2 * stage_of(tile) + 1) * Tr::kKvTileBytes,
                            kN * wgmma::kPanelRowBytes, kSbo);
  };
  auto wait_full = [&](int tile) {
    wgmma::mbarrier_wait(&pipe.full[stage_of(tile)],
                         ((pipe.tiles + tile - first) / Tr::kStages) & 1);
    wgmma::fence_view_async_shared();  // the cp.async data, to the wgmma's (async proxy)
  };
  auto release = [&](int tile) {  // after this warp's wgmma's on the tile completed
    if (lane == 0) wgmma::mbarrier_arrive(&pipe.empty[stage_of(tile)]);
  };
  auto release_q_now = [&]() {
    if (lane == 0) wgmma::mbarrier_arrive(&pipe.q_empty[qb]);
  };
  auto release_q = [&]() {  // after this warp's last Q K^T of the item completed
    if constexpr (!Tr::kQInRegs) release_q_now();
  };
  // Q from registers (kQInRegs): loaded after q_full, the buffer released at once.
  uint32_t qa[Tr::kQInRegs ? Tr::kOTiles / 2 : 1][4];
  auto scores_issue = [&](int tile, float (&s)[Tr::kSTiles* 4]) {
    if constexpr (Tr::kQInRegs) {
      sm90_scores_issue<Tr, T>(qa, k_desc(tile), s);
    } else {
      sm90_scores_issue<Tr, T>(q_desc, k_desc(tile), s);
    }
  };
  // A turn: the stretch in which this warpgroup issues its products.
  auto turn_begin = [&]() {
    if constexpr (Tr::kPingPong) wgmma::named_barrier_sync(kSchedBarrier + group, 256);
  };
  auto turn_end = [&]() {
    if constexpr (Tr::kPingPong) wgmma::named_barrier_arrive(kSchedBarrier + (group ^ 1), 256);
  };

  float o[1][Tr::kOTiles][4] = {};
  float m[1][2] = {{-INFINITY, -INFINITY}};
  float l[1][2] = {{0.f, 0.f}};
  auto o_flat = [&]() -> float (&)[Tr::kOTiles * 4] {
    return reinterpret_cast<float (&)[Tr::kOTiles * 4]>(o);
  };
  using Scores = float[1][Tr::kSTiles][4];
  using Probs = uint32_t[1][kN / 16][4];
  auto s_flat = [](Scores& s) -> float (&)[Tr::kSTiles * 4] {
    return reinterpret_cast<float (&)[Tr::kSTiles * 4]>(s);
  };
  // Scores of `tile` mapped (soft cap) and masked where the tile crosses a row's bounds.
  auto prepare = [&](int tile, Scores& s) {
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
  };
  // Scores of `tile` -> probabilities (packed A fragments), with the rows' rescale factors.
  auto probs = [&](int tile, Scores& s, float (&alpha)[1][2], Probs& pa) {
    prepare(tile, s);
    prefill_probs<Tr, T>(s, m, l, score_mul, alpha, pa);
  };
  // The turn that issues Q K^T of `tile` alone.
  auto first_turn = [&](int tile, Scores& s) {
    wait_full(tile);
    turn_begin();
    wgmma::fence();
    scores_issue(tile, s_flat(s));
    turn_end();
    wgmma::wait<0>();
    wgmma::fence_operands(s_flat(s));
    if (tile + 1 == last) release_q();
  };
  // The turn that issues P V of the last tile (probabilities in pa) alone.
  auto last_turn = [&](Probs& pa) {
    turn_begin();
    wgmma::fence_operands(o_flat());
    wgmma::fence();
    sm90_pv_issue<Tr, T>(pa, v_desc(last - 1), o_flat());
    turn_end();
    wgmma::wait<0>();
    wgmma::fence_operands(o_flat());
    release(last - 1);
  };

  // q_full[qb] was waited for by the caller (it read the item from the buffer's slot).
  if constexpr (Tr::kQInRegs) {
    sm90_load_q_frags<Tr>(q_smem + qb * Tr::kQBytes, tid / kWarpSize, qa);
    release_q_now();
  }
  if (first == last) {
    release_q();
  } else if constexpr (Tr::kSchedule == Sm90Schedule::kOverlap) {
    // Q K^T of `tile` and P V of the tile before it (probabilities in pa_prev) in one turn, the
    // softmax of `tile` into pa under the P V. The loop alternates two pa arrays instead of
    // copying pa back: ptxas serializes the wgmma's when the registers an in-flight wgmma reads
    // are redefined, which a copy's coalescing would do.
    auto step = [&](int tile, Probs& pa_prev, Probs& pa) {
      Scores s;
      wait_full(tile);
      turn_begin();
      wgmma::fence_operands(o_flat());  // the last rescale lands before the wgmma fence
      wgmma::fence();
      scores_issue(tile, s_flat(s));
      sm90_pv_issue<Tr, T>(pa_prev, v_desc(tile - 1), o_flat());
      turn_end();
      wgmma::wait<1>();  // the scores; P V of the previous tile runs under the softmax
      wgmma::fence_operands(s_flat(s));
      if (tile + 1 == last) release_q();
      float alpha[1][2];
      probs(tile, s, alpha, pa);
      wgmma::wait<0>();
      wgmma::fence_operands(o_flat());
      release(tile - 1);
      sm90_rescale<Tr>(o, alpha);
    };
    Probs pa0, pa1;
    {
      Scores s;
      float alpha[1][2];  // o is still zero
      first_turn(first, s);
      probs(first, s, alpha, pa0);
    }
    int tile = first + 1;
    for (; tile + 1 < last; tile += 2) {
      step(tile, pa0, pa1);
      step(tile + 1, pa1, pa0);
    }
    if (tile < last) {
      step(tile, pa0, pa1);
      last_turn(pa1);
    } else {
      last_turn(pa0);
    }
  } else if constexpr (Tr::kSchedule == Sm90Schedule::kSequential) {
    for (int tile = first; tile < last; ++tile) {
      Scores s;
      Probs pa;
      float alpha[1][2];
      first_turn(tile, s);
      probs(tile, s, alpha, pa);
      sm90_rescale<Tr>(o, alpha);
      turn_begin();
      wgmma::fence_operands(o_flat());
      wgmma::fence();
      sm90_pv_issue<Tr, T>(pa, v_desc(tile), o_flat());
      turn_end();
      wgmma::wait<0>();
      wgmma::fence_operands(o_flat());
      release(tile);
    }
  } else {
    // P V of the tile before and Q K^T of `tile` in one turn, both waited for before the
    // softmax: one pa array, the scores and the probabilities never live together with a
    // second tile's.
    Probs pa;
    for (int tile = first; tile < last; ++tile) {
      Scores s;
      if (tile == first) {
        first_turn(tile, s);
      } else {
        wait_full(tile);
        turn_begin();
        wgmma::fence_operands(o_flat());
        wgmma::fence();
        sm90_pv_issue<Tr, T>(pa, v_desc(tile - 1), o_flat());
        scores_issue(tile, s_flat(s));
        turn_end();
        wgmma::wait<0>();
        wgmma::fence_operands(s_flat(s));
        wgmma::fence_operands(o_flat());
        release(tile - 1);
        if (tile + 1 == last) release_q();
      }
      float alpha[1][2];
      probs(tile, s, alpha, pa);
      sm90_rescale<Tr>(o, alpha);
    }
    last_turn(pa);
  }
  if (group_row0 < w.num_rows) {
    store_prefill_rows<Tr, T>(a, w, kv_head, warp_row0, o, m, l, sm.v_scale);
  }
}

template <typename T, int HEAD_SIZE, class Shape>
__global__ void __launch_bounds__((Shape::kConsumerGroups + 1) * kWarpGroupThreads, 1)
    paged_prefill_sm90_kernel(const __grid_constant__ AttnArgs a) {
  using Tr = PrefillSm90Tile<T, HEAD_SIZE, Shape>;
  extern __shared__ __align__(16) unsigned char smem_base[];
  const uint32_t misalign = attn::smem_addr(smem_base) % wgmma::kSwizzleAtomBytes;
  unsigned char* smem = smem_base + (misalign == 0 ? 0 : wgmma::kSwizzleAtomBytes - misalign);
  // Q buffer b at smem + b kQBytes: [panels][kBlockM][64], swizzled. Stage st: K tile at
  // kv_smem + 2 st * kKvTileBytes, V tile after it ([panels][kBlockN][64]). Then the barriers,
  // the items of the Q buffers, the producer's staging items.
  unsigned char* kv_smem = smem + Tr::kQBuffers * Tr::kQBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(kv_smem + Tr::kRingBytes);
  Sm90Pipe pipe{
      bars, bars + Tr::kStages, bars + 2 * Tr::kStages, bars + 2 * Tr::kStages + Tr::kQBuffers, 0,
      0};
  Sm90Item* slots = reinterpret_cast<Sm90Item*>(bars + 2 * Tr::kStages + 2 * Tr::kQBuffers);
  Sm90Item* staging = slots + Tr::kQBuffers;

  const int64_t num_items = prefill_grid_tiles<Tr>(a.p) * a.p.num_kv_heads;
  if (!Tr::kPersistent) {
    WorkTile w;
    int kv_head;
    if (!locate_prefill_tile<Tr>(a, blockIdx.x, w, kv_head)) return;  // CTA-uniform
  }
  if (threadIdx.x == 0) {
    for (int st = 0; st < Tr::kStages; ++st) {
      wgmma::mbarrier_init(&pipe.full[st], Tr::kLoadThreads);
      wgmma::mbarrier_init(&pipe.empty[st], Tr::kConsumerWarps);
    }
    for (int b = 0; b < Tr::kQBuffers; ++b) {
      // + 1: producer thread 0's plain arrival, which publishes the buffer's item slot.
      wgmma::mbarrier_init(&pipe.q_full[b], Tr::kLoadThreads + 1);
      wgmma::mbarrier_init(&pipe.q_empty[b], Tr::kConsumerWarps);
    }
  }
  __syncthreads();
  if (threadIdx.x < kWarpGroupThreads) {
    wgmma::setmaxnreg_dec<Shape::kProducerRegs>();
    // Thread 0 draws the items: the CTA's first is blockIdx.x, every later one the next of the
    // split's counter (the CTAs that finish first take the next items, as the hardware hands
    // out the CTAs of a non-persistent grid); fixed snake order without counters.
    int draws = 0;
    auto draw = [&]() -> int64_t {
      const int k = draws++;
      if (!Tr::kPersistent || k == 0 || a.item_counters == nullptr) return sm90_item<Tr>(k);
      return gridDim.x + static_cast<int64_t>(atomicAdd(&a.item_counters[blockIdx.y], 1));
    };
    for (int u = 0;; ++u) {
      if (threadIdx.x == 0) {
        Sm90Item next;
        next.valid = 0;
        for (int64_t item = draw(); item < num_items; item = draw()) {
          if (locate_prefill_tile<Tr>(a, item, next.w, next.kv_head)) {
            next.valid = 1;
            break;
          }
        }
        staging[u & 1] = next;  // two slots: a slot is rewritten two barriers after its reads
      }
      wgmma::named_barrier_sync(kProducerBarrier, kWarpGroupThreads);
      const Sm90Item it = staging[u & 1];
      const int qb = pipe.qs % Tr::kQBuffers;
      if (pipe.qs >= Tr::kQBuffers) {
        wgmma::mbarrier_wait(&pipe.q_empty[qb], (pipe.qs / Tr::kQBuffers - 1) & 1);
      }
      if (threadIdx.x == 0) slots[qb] = it;
      if (!it.valid) {  // the consumers' signal to stop
        wgmma::mbarrier_arrive(&pipe.q_full[qb]);
        if (threadIdx.x == 0) wgmma::mbarrier_arrive(&pipe.q_full[qb]);
        break;
      }
      sm90_produce<Tr, T>(a, it.w, it.kv_head, smem, kv_smem, pipe);
      pipe.tiles += it.w.tile_end - it.w.tile_begin;
      ++pipe.qs;
    }
    attn::cp_async_wait<0>();  // no copy lands after the producer is gone
  } else {
    wgmma::setmaxnreg_inc<Shape::kConsumerRegs>();
    const int group = (threadIdx.x - kWarpGroupThreads) / kWarpGroupThreads;
    // Group 0 takes the first turn; the last turn's hand-over to it is taken back at the end.
    if (Tr::kPingPong && group == 1) wgmma::named_barrier_arrive(kSchedBarrier, 256);
    for (;;) {
      const int qb = pipe.qs % Tr::kQBuffers;
      wgmma::mbarrier_wait(&pipe.q_full[qb], (pipe.qs / Tr::kQBuffers) & 1);
      const Sm90Item it = slots[qb];  // read before the buffer is released (sm90_consume)
      if (!it.valid) break;
      sm90_consume<Tr, T>(a, it.w, it.kv_head, smem, kv_smem, pipe);
      pipe.tiles += it.w.tile_end - it.w.tile_begin;
      ++pipe.qs;
    }
    if (Tr::kPingPong && group == 0) wgmma::named_barrier_sync(kSchedBarrier, 256);
  }
}

}  // namespace pyorch::kernels
