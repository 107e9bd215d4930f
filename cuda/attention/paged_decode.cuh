// Decode attention over the NHD paged cache: the sequences of a paged_attention call whose query
// rows fit one m16 tile (q_len * group_size <= 16: a decode step of a GQA model, or a few
// speculative tokens). Memory-bound, so everything here serves the KV stream.
//
// Work decomposition. One CTA per (sequence, kv head, KV split), kv head fastest along grid.x, so
// the CTAs that read the other heads of the same cache blocks run side by side. The CTA's 16 rows
// (t * group_size + g, as in paged_attention.cuh) are shared by its WARPS warps; the KV range of
// the split is cut into 16-key warp tiles (one mma k-step), dealt round-robin to the warps, so the
// warps together read WARPS * 16 consecutive keys at a time.
//
// Three shapes (DecodeTile): CTAS_PER_SM = 2, four warps with a ring sized for half of the SM's
// shared memory (big batches: two CTAs per SM); CTAS_PER_SM = 3, four warps with a third of it
// (grids of many CTAs: a short context's CTA is mostly fixed cost, the Q load, the first tile's
// latency and the epilogue, so more resident CTAs hide more of it; attention.cu picks it from the
// grid alone, because a CUDA graph fixes the launch for every context it replays); CTAS_PER_SM =
// 1 when the whole grid fits one CTA per SM (small batches, split long contexts): eight warps
// (four at 192, 256) sharing the whole shared memory, twice the bytes in flight per SM.
// NOTE(decode): measured on H100 against the 4-warp CTA, both with merge_split_kv_kernel: head
// 128 gains only at 1x4k (+1.7 points of copy in a graph; 1x32k and 16x1k within 0.5, so neither
// warps nor bytes in flight limit those); head 64 at 1x32k went from 56 to 63% and head 256 from
// 82 to 84% with the in-launch merge below. On an H200 (bench_paged_attention
// --decode-ctas-per-sm 2|3, steady): the 3-CTA shape against the 2-CTA one, fp8 / bf16 caches,
// 1024 x 128 keys 215 / 157 against 260 / 183 us, 1024 x 4k 84.4 / 101.9% of copy against 75.1 /
// 101.9%, 256 x 2k 79.0 / 99.5% against 72.8 / 97.7%, but 64 x 4k 67.2 / 85.3% against 75.7 /
// 96.2% (512 CTAs: 1.3 waves of three a SM against 1.9 of two), hence the launcher's threshold.
//
// Pipelines. Each warp streams its own tiles through its own kStages-deep cp.async ring and only
// synchronizes with itself (__syncwarp), never with the other warps, so no warp waits on another
// warp's loads and every warp keeps kStages - 1 tiles in flight. fp8 tiles land raw; at tile
// heads 64 and 128 each lane reads its bytes straight into f16 mma fragments
// (paged_decode_fp8.cuh), at other heads each warp unpacks its own tile into a private
// fp16/bf16 tile before the mma.
//
// Epilogue. The warps' (max, sum, output) of the same rows are merged through shared memory; the
// CTA writes `out`, or with num_splits > 1 its normalized partial and log-sum-exp. The split
// partials are combined in the same launch: the last CTA of a (sequence, kv head) to finish (an
// arrival counter in the workspace, see decode_arrive) merges them into `out`. Only the splits
// that hold keys of the sequence take part; one that holds all of them writes `out` itself (a
// CUDA graph sizes the split count for its longest sequence, so most of a short sequence's
// splits are empty). Only a mixed batch (prefill rows beside, whose partials share the
// workspace) leaves every split's partial to merge_split_kv_kernel.
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention/paged_attention.cuh"
#include "attention/paged_decode_fp8.cuh"
#include "common/launch.cuh"

namespace pyorch::kernels {

constexpr int kDecodeWarpKeys = 16;  // keys per warp tile
constexpr int kDecodeMaxRows = 16;   // one m16 tile
constexpr int kDecodeMaxStages = 8;
// The split heuristic's key chunk (attention.cu): one tile for each warp of the 4-warp shape.
constexpr int kDecodeChunkKeys = 4 * kDecodeWarpKeys;
// Hopper: 228 KB of shared memory per SM, 1 KB of it reserved per resident CTA.
constexpr size_t kDecodeSmemPerSm = 228 * 1024;
constexpr size_t kDecodeSmemPerCta = 1024;

// What the split-KV merge of a launch needs beyond AttnArgs. arrivals == nullptr: the CTAs only
// write their partials (a mixed batch; merge_split_kv_kernel combines them).
struct DecodeMergeArgs {
  unsigned long long* arrivals;  // [num_seqs * num_kv_heads] slots: (tag << 16) + CTAs arrived
  unsigned long long tag;        // this call's tag, 1 .. 2^48 - 1 (see decode_arrive)
  int single_split_keys = 0;     // with the in-launch merge: a sequence with at most this many
                                 // keys runs in one split and writes `out` itself
  bool fp8_l2_prefetch = false;  // fp8 K/V copies with an L2 prefetch of 256 bytes (attention.h)
};

// Shared-memory pieces of a decode CTA; no checks, so that the host can size shapes that do not
// fit (DecodeTile asserts on the ones it builds). HEAD_SIZE is the real head size; the tiles hold
// kTileHead dims (attn_tile_head), the ones past HEAD_SIZE zero-filled.
template <typename T, typename CacheT, int HEAD_SIZE>
struct DecodeBytes {
  static constexpr bool kFp8 = std::is_same_v<CacheT, uint8_t>;
  static constexpr int kHeadSize = HEAD_SIZE;
  static constexpr int kTileHead = attn_tile_head(HEAD_SIZE);
  // Padded T row (16 bytes per row of shift): conflict-free ldmatrix for every head size.
  static constexpr int kRowStride = kTileHead + 16 / sizeof(T);
  static constexpr int kCacheRowBytes = HEAD_SIZE * static_cast<int>(sizeof(CacheT));  // global
  static constexpr int kCopyBytes = static_cast<int>(paged_attention_copy_bytes(kCacheRowBytes));
  static constexpr int kRawRowBytes = kTileHead * static_cast<int>(sizeof(CacheT));  // fp8 tile
  // fp8 read straight into mma fragments (tile heads 64, 128): no unpacked tiles, raw rows at
  // the padded pitches of Fp8FragRows; else raw rows of kRawRowBytes, unpacked per warp.
  static constexpr bool kFp8Frag = kFp8 && (kTileHead == 64 || kTileHead == 128);
  static constexpr int kKRawPitch =
      kFp8Frag ? Fp8FragRows < kFp8Frag ? kTileHead : 64 > ::kK : kRawRowBytes;
  static constexpr int kVRawPitch =
      kFp8Frag ? Fp8FragRows < kFp8Frag ? kTileHead : 64 > ::kV : kRawRowBytes;
  // Destination row pitches (bytes) of the K and V tiles in a ring slot.
  static constexpr int kKDstPitch = kFp8 ? kKRawPitch : kRowStride * static_cast<int>(sizeof(T));
  static constexpr int kVDstPitch = kFp8 ? kVRawPitch : kRowStride * static_cast<int>(sizeof(T));
  static constexpr size_t kTTileBytes = sizeof(T) * kDecodeWarpKeys * kRowStride;
  // One ring slot of a warp: the K tile, then the V tile at kVStageOffset.
  static constexpr size_t kVStageOffset = static_cast<size_t>(kDecodeWarpKeys) * kKDstPitch;
  static constexpr size_t kStageBytes =
      kVStageOffset + static_cast<size_t>(kDecodeWarpKeys) * kVDstPitch;
  static constexpr size_t kUnpackBytes = kFp8 && !kFp8Frag ? 2 * kTTileBytes : 0;  // per warp
  static constexpr size_t kQBytes = sizeof(T) * kDecodeMaxRows * kRowStride;
  // Ring depth that fills the CTA's share of the SM (may be < 2: the shape does not fit).
  static constexpr int stages_for(int warps, int ctas_per_sm) {
    return static_cast<int>(
        (kDecodeSmemPerSm / ctas_per_sm - kDecodeSmemPerCta - kQBytes - warps * kUnpackBytes) /
        (warps * kStageBytes));
  }
  // Warps of a CTA that has the SM to itself: 8 where each still gets a 3-deep ring (two tiles in
  // flight), else 4 (head 256) with the deeper ring.
  static constexpr int kWholeSmWarps = stages_for(8, 1) >= 3 ? 8 : 4;
};

template <typename T, typename CacheT, int HEAD_SIZE, int WARPS = 4, int CTAS_PER_SM = 2>
struct DecodeTile : DecodeBytes<T, CacheT, HEAD_SIZE> {
  using B = DecodeBytes<T, CacheT, HEAD_SIZE>;
  static constexpr bool kFp8 = B::kFp8;
  static constexpr bool kFp8Frag = B::kFp8Frag;
  static constexpr int kKDstPitch = B::kKDstPitch;
  static constexpr int kVDstPitch = B::kVDstPitch;
  static constexpr size_t kVStageOffset = B::kVStageOffset;
  static constexpr int kWarps = WARPS;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kHeadSize = B::kHeadSize;
  static constexpr int kTileHead = B::kTileHead;
  static constexpr int kRowStride = B::kRowStride;
  static constexpr int kOTiles = kTileHead / 8;
  static constexpr int kChunkElems = 16 / sizeof(T);
  static constexpr int kCacheRowBytes = B::kCacheRowBytes;
  static constexpr int kCopyBytes = B::kCopyBytes;
  static constexpr int kRawRowBytes = B::kRawRowBytes;
  static constexpr size_t kTTileBytes = B::kTTileBytes;
  static constexpr size_t kStageBytes = B::kStageBytes;
  static constexpr size_t kUnpackBytes = B::kUnpackBytes;
  static constexpr size_t kQBytes = B::kQBytes;
  static constexpr int kAutoStages = B::stages_for(WARPS, CTAS_PER_SM);
  static constexpr int kStages =
      kAutoStages < 2 ? 2 : (kAutoStages > kDecodeMaxStages ? kDecodeMaxStages : kAutoStages);
  static constexpr size_t kWarpBytes = kStages * kStageBytes + kUnpackBytes;
  // The epilogue reuses the warps' rings: [warps][16][kTileHead] outputs, [warps][16] max and
  // sum; then the split merge's "last CTA" flag.
  static constexpr size_t kMergeFloats =
      static_cast<size_t>(kWarps) * kDecodeMaxRows * (kTileHead + 2);
  static constexpr size_t kEpilogueBytes = sizeof(float) * kMergeFloats + 16;
  static constexpr size_t kRingBytes =
      kWarps * kWarpBytes > kEpilogueBytes ? kWarps * kWarpBytes : kEpilogueBytes;
  static constexpr size_t kSmemBytes = kQBytes + kRingBytes;

  static_assert(sizeof(T) == 2, "the tensor-core path takes fp16/bf16");
  static_assert(kTileHead % 16 == 0, "mma k-steps of 16");
  static_assert(HEAD_SIZE % 8 == 0 && kCacheRowBytes % kCopyBytes == 0,
                "whole 16-byte chunks per query row, whole copies per cache row");
  static_assert(kRawRowBytes % 16 == 0, "whole 16-byte chunks per raw fp8 tile row");
  static_assert(kStageBytes % 16 == 0 && kWarpBytes % 16 == 0 && kQBytes % 16 == 0 &&
                    kVStageOffset % 16 == 0 && kKDstPitch % 16 == 0 && kVDstPitch % 16 == 0,
                "16-byte aligned shared-memory tiles");
  static_assert(CTAS_PER_SM >= 1 && CTAS_PER_SM <= 3, "one to three CTAs per SM");
  static_assert(kStages >= 2 && kStages <= kDecodeMaxStages, "ring depth");
  // Head 256 overshoots half the SM even at two stages: its CTAS_PER_SM = 2 shape runs one per SM.
  static_assert(kSmemBytes <= kDecodeSmemPerSm - kDecodeSmemPerCta, "fits Hopper shared memory");
  // Whether CTAS_PER_SM of them fit the SM's shared memory (the launcher uses the 3-CTA shape only
  // where they do; registers are held to it by the kernel's __launch_bounds__).
  static constexpr bool kFitsCtasPerSm =
      CTAS_PER_SM * (kSmemBytes + kDecodeSmemPerCta) <= kDecodeSmemPerSm;
};

// Rows, key range and this split's 16-key tiles of one decode sequence; false if the sequence is
// not the decode kernel's (no query, or more rows than one m16 tile). Same clamps as
// locate_prefill_tile (paged_prefill.cuh), which skips exactly these sequences.
// merge_here: the split partials are merged in this launch (decode_merge_splits); then only the
// splits that hold keys take part (live_splits: the rest of the grid is there for the longest
// sequence the launch was sized, or the CUDA graph captured, for), and a sequence whose keys fit
// one split writes `out` directly. Otherwise every split writes its partial for the merge kernel.
template <int WARPS>
__device__ __forceinline__ bool locate_decode_work(const AttnArgs& a, int seq, bool merge_here,
                                                   int single_split_keys, WorkTile& w) {
  const PagedAttentionParams& p = a.p;
  const int64_t q_start = min(static_cast<int64_t>(p.query_start_loc[seq]), p.num_tokens);
  const int64_t q_end = min(static_cast<int64_t>(p.query_start_loc[seq + 1]), p.num_tokens);
  const int q_len = q_end > q_start ? static_cast<int>(q_end - q_start) : 0;
  const int rows = q_len * a.group_size;
  if (rows == 0 || rows > kDecodeMaxRows) return false;
  w.seq = seq;
  w.q_start = q_start;
  w.num_rows = rows;
  w.row0 = 0;
  const int64_t max_len = p.max_blocks_per_seq * p.block_size;
  w.seq_len =
      static_cast<int>(max(int64_t{0}, min(static_cast<int64_t>(p.seq_lens[seq]), max_len)));
  w.first_pos = w.seq_len - q_len;
  const int win = p.sliding_window;
  w.min_row_hi = p.causal ? w.first_pos + 1 : w.seq_len;
  w.max_row_lo = win > 0 ? w.first_pos + q_len - win : 0;
  w.kv_hi = max(0, p.causal ? min(w.seq_len, w.first_pos + q_len) : w.seq_len);
  w.kv_lo = min(w.kv_hi, win > 0 ? max(0, w.first_pos - win + 1) : 0);
  // Splits take whole chunks of one tile per warp, so that the warps stay balanced.
  const int num_tiles = (w.kv_hi - w.kv_lo + kDecodeWarpKeys - 1) / kDecodeWarpKeys;
  const int num_chunks = (num_tiles + WARPS - 1) / WARPS;
  // A short sequence in a grid sized for longer ones (a CUDA graph captured for max_model_len)
  // takes one split: a few live splits of one chunk each cost the merge's partials, arrivals
  // and reads more than their parallel loads save (single_split_keys).
  int per_split = (num_chunks + a.num_splits - 1) / a.num_splits;
  if (merge_here && w.kv_hi - w.kv_lo <= single_split_keys) per_split = num_chunks;
  w.tile_begin = min(num_tiles, static_cast<int>(blockIdx.y) * per_split * WARPS);
  w.tile_end = min(num_tiles, w.tile_begin + per_split * WARPS);
  w.live_splits =
      merge_here && per_split > 0 ? (num_chunks + per_split - 1) / per_split : a.num_splits;
  if (merge_here && w.live_splits < 1) w.live_splits = 1;
  return true;
}

// cp.async of the CTA's 16 query rows into q_smem [16][kRowStride]; rows past num_rows and dims
// past the head size are zeros.
template <class Tr, typename T>
__device__ void load_decode_q(const AttnArgs& a, const WorkTile& w, int kv_head, T* q_smem) {
  constexpr int kChunksPerRow = Tr::kOTiles * 8 / Tr::kChunkElems;
  const T* query = static_cast<const T*>(a.p.query);
  for (int c = threadIdx.x; c < kDecodeMaxRows * kChunksPerRow; c += Tr::kThreads) {
    const int r = c / kChunksPerRow;
    const int col = c % kChunksPerRow;
    const bool valid =
        r < w.num_rows && (Tr::kTileHead == Tr::kHeadSize || col * Tr::kChunkElems < Tr::kHeadSize);
    const T* src = query;
    if (valid) {
      const int64_t token = w.q_start + r / a.group_size;
      const int64_t head = static_cast<int64_t>(kv_head) * a.group_size + r % a.group_size;
      src = query + token * a.p.q_token_stride + head * a.p.q_head_stride + col * Tr::kChunkElems;
    }
    attn::cp_async_16(q_smem + r * Tr::kRowStride + col * Tr::kChunkElems, src, valid);
  }
}

// One warp's cp.async of keys [key0, key0 + 16) of kv_head into k_dst/v_dst: padded T tiles, or
// raw [16][kTileHead] byte tiles for fp8, in copies of kCopyBytes. Keys >= kv_hi are zero-filled
// and never read (their block-table entries may be stale), and so are the dims past the head size
// (col_valid). `one_block`: the 16 keys lie in one cache block (block_size a multiple of 16 and an
// aligned key range), so the block table is read once per tile.
template <class Tr, typename CacheT>
__device__ __forceinline__ void load_decode_kv(const AttnArgs& a, const WorkTile& w, int kv_head,
                                               int key0, bool one_block, char* k_dst, char* v_dst,
                                               bool l2_prefetch = false) {
  constexpr int kCopy = Tr::kCopyBytes;
  constexpr int kChunksPerRow = Tr::kTileHead * static_cast<int>(sizeof(CacheT)) / kCopy;
  constexpr int kChunks = kDecodeWarpKeys * kChunksPerRow;
  constexpr int kElemsPerCopy = kCopy / static_cast<int>(sizeof(CacheT));
  auto col_valid = [](int col) {
    return Tr::kTileHead == Tr::kHeadSize || col * kCopy < Tr::kCacheRowBytes;
  };
  // fp8 rows are short (128 bytes at head 128): optionally have L2 fetch 256 bytes around each
  // (the neighbouring kv heads' rows, which other CTAs are about to read; attention.h).
  auto copy = [l2_prefetch](char* dst, const char* src, bool valid) {
    if constexpr (Tr::kFp8 && kCopy == 16) {
      if (l2_prefetch) {
        attn::cp_async_16_l2_256(dst, src, valid);
        return;
      }
    }
    attn::cp_async<kCopy>(dst, src, valid);
  };
  const PagedAttentionParams& p = a.p;
  const char* k_cache = static_cast<const char*>(p.key_cache);
  const char* v_cache = static_cast<const char*>(p.value_cache);
  const int32_t* blocks = p.block_table + static_cast<int64_t>(w.seq) * p.block_table_stride;
  const int block_size = static_cast<int>(p.block_size);
  const int lane = threadIdx.x % kWarpSize;
  int64_t tile_block = 0;
  int tile_offset = 0;
  if (one_block && key0 < w.kv_hi) {
    tile_block = blocks[key0 / block_size];
    tile_offset = key0 % block_size;
  }
  if constexpr (kWarpSize % kChunksPerRow == 0) {
    if (one_block) {  // one block: per-lane pointers, stepped by whole rows (fewer 64-bit ops)
      constexpr int kRowsPerStep = kWarpSize / kChunksPerRow;
      const int n0 = lane / kChunksPerRow;
      const int col = lane % kChunksPerRow;
      const bool in_row = col_valid(col);
      const int64_t elem = col * kElemsPerCopy;
      const char* k_src = k_cache + sizeof(CacheT) * (tile_block * p.k_block_stride +
                                                      (tile_offset + n0) * p.k_token_stride +
                                                      kv_head * p.k_head_stride + elem);
      const char* v_src = v_cache + sizeof(CacheT) * (tile_block * p.v_block_stride +
                                                      (tile_offset + n0) * p.v_token_stride +
                                                      kv_head * p.v_head_stride + elem);
      const int64_t k_step = sizeof(CacheT) * kRowsPerStep * p.k_token_stride;
      const int64_t v_step = sizeof(CacheT) * kRowsPerStep * p.v_token_stride;
#pragma unroll
      for (int it = 0; it < kDecodeWarpKeys / kRowsPerStep; ++it) {
        const int n = it * kRowsPerStep + n0;
        const bool valid = in_row && key0 + n < w.kv_hi;
        copy(k_dst + n * Tr::kKDstPitch + col * kCopy, valid ? k_src : k_cache, valid);
        copy(v_dst + n * Tr::kVDstPitch + col * kCopy, valid ? v_src : v_cache, valid);
        k_src += k_step;
        v_src += v_step;
      }
      return;
    }
  }
#pragma unroll
  for (int it = 0; it < (kChunks + kWarpSize - 1) / kWarpSize; ++it) {
    const int c = it * kWarpSize + lane;
    if (kChunks % kWarpSize != 0 && c >= kChunks) break;
    const int n = c / kChunksPerRow;
    const int col = c % kChunksPerRow;
    const int key = key0 + n;
    const bool valid = key < w.kv_hi && col_valid(col);
    const char* k_src = k_cache;
    const char* v_src = v_cache;
    if (valid) {
      const int64_t block = one_block ? tile_block : blocks[key / block_size];
      const int64_t offset = one_block ? tile_offset + n : key % block_size;
      const int64_t elem = col * kElemsPerCopy;
      k_src += sizeof(CacheT) * (block * p.k_block_stride + offset * p.k_token_stride +
                                 kv_head * p.k_head_stride + elem);
      v_src += sizeof(CacheT) * (block * p.v_block_stride + offset * p.v_token_stride +
                                 kv_head * p.v_head_stride + elem);
    }
    copy(k_dst + n * Tr::kKDstPitch + col * kCopy, k_src, valid);
    copy(v_dst + n * Tr::kVDstPitch + col * kCopy, v_src, valid);
  }
}

// One warp: raw fp8 tile [16][kTileHead] -> padded T tile [16][kRowStride] (scale applied later).
template <class Tr, typename T>
__device__ __forceinline__ void unpack_decode_fp8(const uint8_t* raw, T* dst) {
  constexpr int kChunksPerRow = Tr::kRawRowBytes / 16;
  const int lane = threadIdx.x % kWarpSize;
  constexpr int kChunks = kDecodeWarpKeys * kChunksPerRow;
#pragma unroll
  for (int it = 0; it < (kChunks + kWarpSize - 1) / kWarpSize; ++it) {
    const int c = it * kWarpSize + lane;
    if (kChunks % kWarpSize != 0 && c >= kChunks) break;
    const int n = c / kChunksPerRow;
    const int col = c % kChunksPerRow;
    const uint4 in = *reinterpret_cast<const uint4*>(raw + n * Tr::kRawRowBytes + col * 16);
    uint4* out = reinterpret_cast<uint4*>(dst + n * Tr::kRowStride + col * 16);
    attn::fp8x16_to<T>(in, out[0], out[1]);
  }
}

// Merges the warps' (max, sum, output) of the CTA's rows through `scratch` (the rings, free once
// every warp is done), normalizes, and writes `out` or the split's partial slot and log-sum-exp
// (natural log; -inf for a row that saw no key).
template <class Tr, typename T>
__device__ void decode_merge_warps(const AttnArgs& a, const WorkTile& w, int kv_head, int split,
                                   const float (&o)[Tr::kOTiles][4], const float (&m)[2],
                                   const float (&l)[2], float v_scale, float* scratch) {
  constexpr int kTile = Tr::kOTiles * 8;  // head dims of the accumulators
  constexpr int kHead = Tr::kHeadSize;    // ... of which are stored (partial rows: kHead floats)
  constexpr int kRows = kDecodeMaxRows;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  float* red_o = scratch;                             // [warps][16][kTile]
  float* red_m = red_o + Tr::kWarps * kRows * kTile;  // [warps][16]
  float* red_l = red_m + Tr::kWarps * kRows;          // [warps][16]
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float sum = l[i];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int r = lane / 4 + 8 * i;
    if (r >= w.num_rows) continue;
    if constexpr (Tr::kFp8Frag) {  // o[j][2i + e] is head dim fp8frag_out_dim(j, lane % 4, e)
      float* dst = red_o + (warp * kRows + r) * kTile;
#pragma unroll
      for (int j = 0; j < Tr::kOTiles; ++j) {
        dst[fp8frag_out_dim<kTile>(j, lane % 4, 0)] = o[j][2 * i];
        dst[fp8frag_out_dim<kTile>(j, lane % 4, 1)] = o[j][2 * i + 1];
      }
    } else {
      float* dst = red_o + (warp * kRows + r) * kTile + (lane % 4) * 2;
#pragma unroll
      for (int j = 0; j < Tr::kOTiles; ++j) {
        *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[j][2 * i], o[j][2 * i + 1]);
      }
    }
    if (lane % 4 == 0) {
      red_m[warp * kRows + r] = m[i];
      red_l[warp * kRows + r] = sum;
    }
  }
  __syncthreads();
  const PagedAttentionParams& p = a.p;
  for (int idx = threadIdx.x; idx < w.num_rows * (kHead / 2); idx += Tr::kThreads) {
    const int r = idx / (kHead / 2);
    const int col = (idx % (kHead / 2)) * 2;
    float m_max = -INFINITY;
#pragma unroll
    for (int v = 0; v < Tr::kWarps; ++v) m_max = fmaxf(m_max, red_m[v * kRows + r]);
    const float m_use = m_max == -INFINITY ? 0.f : m_max;
    float sum = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int v = 0; v < Tr::kWarps; ++v) {
      const float scale = exp2f(red_m[v * kRows + r] - m_use);
      sum += red_l[v * kRows + r] * scale;
      const float2 x = *reinterpret_cast<const float2*>(red_o + (v * kRows + r) * kTile + col);
      o0 += x.x * scale;
      o1 += x.y * scale;
    }
    const int64_t token = w.q_start + r / a.group_size;
    const int64_t head = static_cast<int64_t>(kv_head) * a.group_size + r % a.group_size;
    const float inv = sum > 0.f ? v_scale / sum : 0.f;
    if (w.live_splits == 1) {
      T* dst = static_cast<T*>(p.out) + token * p.out_token_stride + head * p.out_head_stride + col;
      *reinterpret_cast<uint32_t*>(dst) = attn::pack2<T>(o0 * inv, o1 * inv);
      if (p.lse != nullptr && col == 0) {
        p.lse[head * p.lse_head_stride + token] =
            sum > 0.f ? (m_max + log2f(sum)) * kLn2 : -INFINITY;
      }
    } else {
      const int64_t slot =
          (static_cast<int64_t>(split) * p.num_tokens + token) * p.num_heads + head;
      *reinterpret_cast<float2*>(a.o_partial + slot * kHead + col) =
          make_float2(o0 * inv, o1 * inv);
      if (col == 0) a.lse_partial[slot] = sum > 0.f ? (m_max + log2f(sum)) * kLn2 : -INFINITY;
    }
  }
}

// Counts this CTA in at its (sequence, kv head) slot and returns how many of the slot's
// live_splits CTAs have arrived, itself included. The workspace comes from a caching allocator
// with anything in it, so a slot is only believed when its upper 48 bits hold this call's tag
// (a fresh one per call, see next_decode_tag in attention.cu); any other value counts as none
// arrived, and the first CTA to see one swaps in (tag, 1). Everyone after adds 1: an atomic add,
// not a compare-and-swap loop, whose retries cost a round trip each when the 16 or more CTAs of a
// slot finish together (measured: 3 us more at 1x4k). acq_rel: releases this CTA's partial
// (ordered before by the caller's __syncthreads) and acquires the earlier arrivals'. The last CTA
// puts 0 back, so that a CUDA graph, which replays the tag it was captured with, finds no stale
// count of its own.
__device__ __forceinline__ int decode_arrive(unsigned long long* slot, unsigned long long tag) {
  unsigned long long seen;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(slot) : "memory");
  while ((seen >> 16) != tag) {
    const unsigned long long first = (tag << 16) + 1;
    unsigned long long prev;
    asm volatile("atom.acq_rel.gpu.global.cas.b64 %0, [%1], %2, %3;"
                 : "=l"(prev)
                 : "l"(slot), "l"(seen), "l"(first)
                 : "memory");
    if (prev == seen) return 1;
    seen = prev;  // another CTA of the slot got there first (or the read was stale)
  }
  unsigned long long old;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(old) : "l"(slot) : "memory");
  return static_cast<int>(old & 0xffff) + 1;
}

// After decode_merge_warps has written this split's partial: the last CTA of the (sequence, kv
// head) to arrive merges the live_splits partials of its rows into `out` (the sums of
// merge_split_kv_kernel, e^{lse_s - max} o_s / sum_s e^{lse_s - max}); the others return. One
// thread per (row, 4 dims) reads the splits kMergeBatch at a time, log-sum-exps and partials
// together, with a running max, so that up to 16 splits cost one L2 round trip.
template <class Tr, typename T>
__device__ void decode_merge_splits(const AttnArgs& a, const DecodeMergeArgs& mg, const WorkTile& w,
                                    int kv_head, float* scratch) {
  constexpr int kHead = Tr::kHeadSize;  // floats per partial row
  constexpr int kVecs = kHead / 4;      // float4 columns of a row
  constexpr int kMergeBatch = 16;
  int* is_last = reinterpret_cast<int*>(scratch + Tr::kMergeFloats);
  __syncthreads();  // every thread's partial stores, before thread 0's release in decode_arrive
  if (threadIdx.x == 0) {
    const int arrived = decode_arrive(mg.arrivals + blockIdx.x, mg.tag);
    *is_last = arrived == w.live_splits;
    if (arrived == w.live_splits) mg.arrivals[blockIdx.x] = 0;  // all counted: ready for a replay
  }
  __syncthreads();  // the other CTAs' partials (acquired by thread 0), before the reads below
  if (!*is_last) return;

  const PagedAttentionParams& p = a.p;
  const int64_t split_stride = p.num_tokens * p.num_heads;  // partial slots per split
  for (int i = threadIdx.x; i < w.num_rows * kVecs; i += Tr::kThreads) {
    const int r = i / kVecs;
    const int v = i % kVecs;
    const int64_t token = w.q_start + r / a.group_size;
    const int64_t head = static_cast<int64_t>(kv_head) * a.group_size + r % a.group_size;
    const int64_t slot = token * p.num_heads + head;  // in split 0
    float run_max = -INFINITY, run_sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < w.live_splits; s0 += kMergeBatch) {
      float lse[kMergeBatch];
      float4 x[kMergeBatch];
      // L2 reads (__ldcg): other SMs wrote these during this launch.
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) {
        const int64_t at = (s0 + j) * split_stride + slot;
        const bool valid = s0 + j < w.live_splits;
        lse[j] = valid ? __ldcg(a.lse_partial + at) : -INFINITY;
        x[j] = valid ? __ldcg(reinterpret_cast<const float4*>(a.o_partial + at * kHead) + v)
                     : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float new_max = run_max;
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) new_max = fmaxf(new_max, lse[j]);
      if (new_max == -INFINITY) continue;             // no split so far saw a key
      const float rescale = expf(run_max - new_max);  // 0 while run_max is -inf
      run_sum *= rescale;
      acc = make_float4(acc.x * rescale, acc.y * rescale, acc.z * rescale, acc.w * rescale);
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) {
        const float e = expf(lse[j] - new_max);  // 0 for an empty split (its partial is zeros)
        run_sum += e;
        acc.x += e * x[j].x;
        acc.y += e * x[j].y;
        acc.z += e * x[j].z;
        acc.w += e * x[j].w;
      }
      run_max = new_max;
    }
    const float inv = run_sum > 0.f ? 1.f / run_sum : 0.f;  // no split saw a key: zeros
    if (p.lse != nullptr && v == 0) {
      p.lse[head * p.lse_head_stride + token] = run_sum > 0.f ? run_max + logf(run_sum) : -INFINITY;
    }
    T* dst = static_cast<T*>(p.out) + token * p.out_token_stride + head * p.out_head_stride + 4 * v;
    reinterpret_cast<uint32_t*>(dst)[0] = attn::pack2<T>(acc.x * inv, acc.y * inv);
    reinterpret_cast<uint32_t*>(dst)[1] = attn::pack2<T>(acc.z * inv, acc.w * inv);
  }
}

// grid: (num_seqs * num_kv_heads, num_splits); block: WARPS warps; dynamic shared memory
// DecodeTile<T, CacheT, HEAD_SIZE, WARPS, CTAS_PER_SM>::kSmemBytes. The register budget leaves
// room for CTAS_PER_SM CTAs an SM (the fp8 fragment path takes ~160 registers a thread: three
// 4-warp CTAs fit, four would not).
template <typename T, typename CacheT, int HEAD_SIZE, int WARPS, int CTAS_PER_SM>
__global__ void __launch_bounds__(WARPS* kWarpSize, CTAS_PER_SM)
    paged_decode_kernel(const __grid_constant__ AttnArgs a,
                        const __grid_constant__ DecodeMergeArgs mg) {
  using Tr = DecodeTile<T, CacheT, HEAD_SIZE, WARPS, CTAS_PER_SM>;
  constexpr int kStages = Tr::kStages;
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_smem = reinterpret_cast<T*>(smem);  // [16][kRowStride]
  // Launched with PDL (common/launch.cuh): wait for the kernels that wrote q and the cache, then
  // let the next kernel (a mixed batch's merge_split_kv_kernel, or the output projection) be
  // scheduled; it waits for this grid in turn.
  pdl_wait();
  pdl_launch_dependents();

  const int num_kv_heads = static_cast<int>(a.p.num_kv_heads);
  const int seq = blockIdx.x / num_kv_heads;
  const int kv_head = blockIdx.x % num_kv_heads;
  WorkTile w;
  const bool merge_here = a.num_splits > 1 && mg.arrivals != nullptr;
  if (!locate_decode_work<WARPS>(a, seq, merge_here, mg.single_split_keys, w)) return;
  // A split past the sequence's keys adds nothing: it writes no partial and does not arrive.
  if (static_cast<int>(blockIdx.y) >= w.live_splits) return;

  const int warp = threadIdx.x / kWarpSize;
  // [warps][kStages][K, V] rings, then (fp8) each warp's unpacked K and V tiles.
  char* ring = reinterpret_cast<char*>(smem) + Tr::kQBytes + warp * Tr::kWarpBytes;
  auto k_stage = [&](int s) { return ring + s * Tr::kStageBytes; };
  auto v_stage = [&](int s) { return ring + s * Tr::kStageBytes + Tr::kVStageOffset; };
  const int first_tile = w.tile_begin + warp;
  const int num_my_tiles =
      first_tile < w.tile_end ? (w.tile_end - first_tile + WARPS - 1) / WARPS : 0;
  const bool one_block = a.p.block_size % kDecodeWarpKeys == 0 && w.kv_lo % kDecodeWarpKeys == 0;
  auto load = [&](int i) {  // the warp's i-th tile into ring slot i % kStages
    const int key0 = w.kv_lo + (first_tile + i * WARPS) * kDecodeWarpKeys;
    load_decode_kv<Tr, CacheT>(a, w, kv_head, key0, one_block, k_stage(i % kStages),
                               v_stage(i % kStages), mg.fp8_l2_prefetch);
  };

  load_decode_q<Tr>(a, w, kv_head, q_smem);  // joins the first commit group
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < num_my_tiles) load(i);
    attn::cp_async_commit();  // possibly empty: keeps the group count uniform
  }
  attn::cp_async_wait<kStages - 2>();  // this thread's query chunks (and first tile) landed
  __syncthreads();                     // everyone's query chunks are visible

  const RowBounds rb = row_bounds<Tr>(a, w, 0);
  const bool upper_rows = w.num_rows > 8;  // does the tile's second half (rows 8-15) hold rows?
  const ScoreMap sm = make_score_map<Tr>(a.p);
  float o[Tr::kOTiles][4] = {};
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};
  // fp8 fragments: the query as f16 fragments in registers, rows scaled by 2^e (q_row_inv: 2^-e).
  uint32_t qf[Tr::kTileHead / 16][4];
  float q_row_inv[2] = {1.f, 1.f};
  if constexpr (Tr::kFp8Frag) {
    load_q_fp8frag<Tr::kTileHead, Tr::kRowStride>(q_smem, qf, q_row_inv);
  }
  for (int i = 0; i < num_my_tiles; ++i) {
    // Refill the slot consumed in the previous iteration (the __syncwarp below ended its reads).
    if (i + kStages - 1 < num_my_tiles) load(i + kStages - 1);
    attn::cp_async_commit();
    attn::cp_async_wait<kStages - 1>();  // tile i has landed (for this lane)
    __syncwarp();                        // ... and for the whole warp
    const int k0 = w.kv_lo + (first_tile + i * WARPS) * kDecodeWarpKeys;
    const bool need_mask = k0 + kDecodeWarpKeys > w.min_row_hi || k0 < w.max_row_lo;
    float s[kDecodeWarpKeys / 8][4];
    if constexpr (Tr::kFp8Frag) {
      const auto* k_raw = reinterpret_cast<const uint8_t*>(k_stage(i % kStages));
      compute_scores_fp8frag<Tr::kTileHead>(qf, k_raw, s);
#pragma unroll
      for (int j = 0; j < kDecodeWarpKeys / 8; ++j) {  // undo the rows' 2^e (exact)
        s[j][0] *= q_row_inv[0];
        s[j][1] *= q_row_inv[0];
        s[j][2] *= q_row_inv[1];
        s[j][3] *= q_row_inv[1];
      }
      online_softmax<Tr, kDecodeWarpKeys>(s, o, m, l, rb, k0, need_mask, sm, upper_rows);
      const auto* v_raw = reinterpret_cast<const uint8_t*>(v_stage(i % kStages));
      accumulate_pv_fp8frag<Tr::kTileHead>(s, v_raw, o);
      __syncwarp();  // every lane is done with slot i % kStages before it is refilled
      continue;
    }
    const T* k_tile = reinterpret_cast<const T*>(k_stage(i % kStages));
    const T* v_tile = reinterpret_cast<const T*>(v_stage(i % kStages));
    if constexpr (Tr::kFp8) {
      T* k_unpacked = reinterpret_cast<T*>(ring + kStages * Tr::kStageBytes);
      T* v_unpacked = reinterpret_cast<T*>(ring + kStages * Tr::kStageBytes + Tr::kTTileBytes);
      unpack_decode_fp8<Tr>(reinterpret_cast<const uint8_t*>(k_tile), k_unpacked);
      unpack_decode_fp8<Tr>(reinterpret_cast<const uint8_t*>(v_tile), v_unpacked);
      __syncwarp();
      k_tile = k_unpacked;
      v_tile = v_unpacked;
    }
    compute_scores<Tr, kDecodeWarpKeys>(q_smem, k_tile, s);
    online_softmax<Tr, kDecodeWarpKeys>(s, o, m, l, rb, k0, need_mask, sm, upper_rows);
    accumulate_pv<Tr, kDecodeWarpKeys>(s, v_tile, o);
    __syncwarp();  // every lane is done with slot i % kStages before it is refilled
  }
  attn::cp_async_wait<0>();
  __syncthreads();  // the epilogue's scratch overlays every warp's ring
  float* scratch = reinterpret_cast<float*>(smem + Tr::kQBytes);
  decode_merge_warps<Tr, T>(a, w, kv_head, blockIdx.y, o, m, l, sm.v_scale, scratch);
  if (w.live_splits > 1 && mg.arrivals != nullptr) {
    decode_merge_splits<Tr, T>(a, mg, w, kv_head, scratch);
  }
}

}  // namespace pyorch::kernels
