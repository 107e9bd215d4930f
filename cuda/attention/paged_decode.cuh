// Decode attention over the NHD paged cache: the sequences of a paged_attention call whose query
// rows fit one m16 tile (q_len * group_size <= 16: a decode step of a GQA model, or a few
// speculative tokens). Memory-bound, so everything here serves the KV stream.
//
// Work decomposition. One CTA per (sequence, kv head, KV split), kv head fastest along grid.x, so
// the CTAs that read the other heads of the same cache blocks run side by side. The CTA's 16 rows
// (t * group_size + g, as in paged_attention.cuh) are shared by its 4 warps; the KV range of the
// split is cut into 16-key warp tiles (one mma k-step), dealt round-robin to the warps, so the
// four warps together read 64 consecutive keys at a time.
//
// Pipelines. Each warp streams its own tiles through its own kStages-deep cp.async ring and only
// synchronizes with itself (__syncwarp), never with the other warps, so no warp waits on another
// warp's loads and every warp keeps kStages - 1 tiles in flight. Shared memory per CTA is sized
// for two CTAs per SM on Hopper (kDecodeSmemTarget). fp8 tiles land raw and each warp unpacks its
// own tile into a private fp16/bf16 tile before the mma.
//
// Epilogue. The warps' (max, sum, output) of the same rows are merged through shared memory; the
// CTA writes `out`, or with num_splits > 1 its normalized partial and log-sum-exp, which
// merge_split_kv_kernel combines (launched with programmatic dependent launch, so its launch
// overlaps this kernel: see griddepcontrol below).
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention/paged_attention.cuh"

namespace pyorch::kernels {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeWarpKeys = 16;                                 // keys per warp tile
constexpr int kDecodeChunkKeys = kDecodeWarps * kDecodeWarpKeys;  // split granularity
constexpr int kDecodeMaxRows = 16;                                 // one m16 tile
constexpr int kDecodeMaxStages = 8;
// Two CTAs per SM: Hopper has 228 KB of shared memory per SM and reserves 1 KB per CTA.
constexpr size_t kDecodeSmemTarget = 113 * 1024;

template <typename T, typename CacheT, int HEAD_SIZE, int STAGES = 0>
struct DecodeTile {
  static constexpr bool kFp8 = std::is_same_v<CacheT, uint8_t>;
  static constexpr int kWarps = kDecodeWarps;
  static constexpr int kThreads = kWarps * kWarpSize;
  // Padded T row (16 bytes per row of shift): conflict-free ldmatrix for every head size.
  static constexpr int kRowStride = HEAD_SIZE + 16 / sizeof(T);
  static constexpr int kOTiles = HEAD_SIZE / 8;
  static constexpr int kChunkElems = 16 / sizeof(T);
  static constexpr int kCacheRowBytes = HEAD_SIZE * static_cast<int>(sizeof(CacheT));
  static constexpr size_t kTTileBytes = sizeof(T) * kDecodeWarpKeys * kRowStride;
  static constexpr size_t kRawTileBytes = static_cast<size_t>(kDecodeWarpKeys) * kCacheRowBytes;
  // One ring slot of a warp: K then V, padded T tiles, or raw byte tiles for fp8.
  static constexpr size_t kStageBytes = kFp8 ? 2 * kRawTileBytes : 2 * kTTileBytes;
  static constexpr size_t kUnpackBytes = kFp8 ? 2 * kTTileBytes : 0;  // per warp, fp8 only
  static constexpr size_t kQBytes = sizeof(T) * kDecodeMaxRows * kRowStride;
  static constexpr int kAutoStages = static_cast<int>(
      (kDecodeSmemTarget - kQBytes - kWarps * kUnpackBytes) / (kWarps * kStageBytes));
  static constexpr int kStages =
      STAGES > 0 ? STAGES
                 : (kAutoStages < 2 ? 2 : (kAutoStages > kDecodeMaxStages ? kDecodeMaxStages
                                                                          : kAutoStages));
  static constexpr size_t kWarpBytes = kStages * kStageBytes + kUnpackBytes;
  // The epilogue reuses the warps' rings: [warps][16][HEAD_SIZE] outputs, [warps][16] max and sum.
  static constexpr size_t kMergeBytes = sizeof(float) * kWarps * kDecodeMaxRows * (HEAD_SIZE + 2);
  static constexpr size_t kRingBytes =
      kWarps * kWarpBytes > kMergeBytes ? kWarps * kWarpBytes : kMergeBytes;
  static constexpr size_t kSmemBytes = kQBytes + kRingBytes;

  static_assert(sizeof(T) == 2, "the tensor-core path takes fp16/bf16");
  static_assert(HEAD_SIZE % 16 == 0, "mma k-steps of 16");
  static_assert(kCacheRowBytes % 16 == 0, "whole 16-byte chunks per cache row");
  static_assert(kStageBytes % 16 == 0 && kWarpBytes % 16 == 0 && kQBytes % 16 == 0,
                "16-byte aligned shared-memory tiles");
  static_assert(kStages >= 2 && kStages <= kDecodeMaxStages, "ring depth");
  static_assert(kSmemBytes <= 227 * 1024, "fits Hopper shared memory");
};

// Rows, key range and this split's 16-key tiles of one decode sequence; false if the sequence is
// not the decode kernel's (no query, or more rows than one m16 tile). Same clamps as
// locate_prefill_tile (paged_prefill.cuh), which skips exactly these sequences.
__device__ __forceinline__ bool locate_decode_work(const AttnArgs& a, int seq, WorkTile& w) {
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
  // Splits take whole 64-key chunks, so that the four warps stay balanced.
  const int num_tiles = (w.kv_hi - w.kv_lo + kDecodeWarpKeys - 1) / kDecodeWarpKeys;
  const int num_chunks = (num_tiles + kDecodeWarps - 1) / kDecodeWarps;
  const int per_split = (num_chunks + a.num_splits - 1) / a.num_splits;
  w.tile_begin = min(num_tiles, static_cast<int>(blockIdx.y) * per_split * kDecodeWarps);
  w.tile_end = min(num_tiles, w.tile_begin + per_split * kDecodeWarps);
  return true;
}

// cp.async of the CTA's 16 query rows into q_smem [16][kRowStride]; rows past num_rows are zeros.
template <class Tr, typename T>
__device__ void load_decode_q(const AttnArgs& a, const WorkTile& w, int kv_head, T* q_smem) {
  constexpr int kChunksPerRow = Tr::kOTiles * 8 / Tr::kChunkElems;
  const T* query = static_cast<const T*>(a.p.query);
  for (int c = threadIdx.x; c < kDecodeMaxRows * kChunksPerRow; c += Tr::kThreads) {
    const int r = c / kChunksPerRow;
    const int col = c % kChunksPerRow;
    const bool valid = r < w.num_rows;
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
// raw [16][HEAD_SIZE] byte tiles for fp8. Keys >= kv_hi are zero-filled and never read (their
// block-table entries may be stale). `one_block`: the 16 keys lie in one cache block (block_size
// a multiple of 16 and an aligned key range), so the block table is read once per tile.
template <class Tr, typename CacheT>
__device__ __forceinline__ void load_decode_kv(const AttnArgs& a, const WorkTile& w, int kv_head,
                                               int key0, bool one_block, char* k_dst,
                                               char* v_dst) {
  constexpr int kChunksPerRow = Tr::kCacheRowBytes / 16;
  constexpr int kChunks = kDecodeWarpKeys * kChunksPerRow;
  constexpr int kDstRowBytes = Tr::kFp8 ? Tr::kCacheRowBytes : Tr::kRowStride * 2;
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
      const int64_t elem = col * (16 / static_cast<int>(sizeof(CacheT)));
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
        const bool valid = key0 + n < w.kv_hi;
        const int dst = n * kDstRowBytes + col * 16;
        attn::cp_async_16(k_dst + dst, valid ? k_src : k_cache, valid);
        attn::cp_async_16(v_dst + dst, valid ? v_src : v_cache, valid);
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
    const bool valid = key < w.kv_hi;
    const char* k_src = k_cache;
    const char* v_src = v_cache;
    if (valid) {
      const int64_t block = one_block ? tile_block : blocks[key / block_size];
      const int64_t offset = one_block ? tile_offset + n : key % block_size;
      const int64_t elem = col * (16 / static_cast<int>(sizeof(CacheT)));
      k_src += sizeof(CacheT) * (block * p.k_block_stride + offset * p.k_token_stride +
                                 kv_head * p.k_head_stride + elem);
      v_src += sizeof(CacheT) * (block * p.v_block_stride + offset * p.v_token_stride +
                                 kv_head * p.v_head_stride + elem);
    }
    const int dst = n * kDstRowBytes + col * 16;
    attn::cp_async_16(k_dst + dst, k_src, valid);
    attn::cp_async_16(v_dst + dst, v_src, valid);
  }
}

// One warp: raw fp8 tile [16][HEAD_SIZE] -> padded T tile [16][kRowStride] (scale applied later).
template <class Tr, typename T>
__device__ __forceinline__ void unpack_decode_fp8(const uint8_t* raw, T* dst) {
  constexpr int kChunksPerRow = Tr::kCacheRowBytes / 16;
  const int lane = threadIdx.x % kWarpSize;
  constexpr int kChunks = kDecodeWarpKeys * kChunksPerRow;
#pragma unroll
  for (int it = 0; it < (kChunks + kWarpSize - 1) / kWarpSize; ++it) {
    const int c = it * kWarpSize + lane;
    if (kChunks % kWarpSize != 0 && c >= kChunks) break;
    const int n = c / kChunksPerRow;
    const int col = c % kChunksPerRow;
    const uint4 in = *reinterpret_cast<const uint4*>(raw + n * Tr::kCacheRowBytes + col * 16);
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
  constexpr int kHead = Tr::kOTiles * 8;
  constexpr int kRows = kDecodeMaxRows;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  float* red_o = scratch;                          // [warps][16][kHead]
  float* red_m = red_o + Tr::kWarps * kRows * kHead;  // [warps][16]
  float* red_l = red_m + Tr::kWarps * kRows;          // [warps][16]
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float sum = l[i];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int r = lane / 4 + 8 * i;
    if (r >= w.num_rows) continue;
    float* dst = red_o + (warp * kRows + r) * kHead + (lane % 4) * 2;
#pragma unroll
    for (int j = 0; j < Tr::kOTiles; ++j) {
      *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[j][2 * i], o[j][2 * i + 1]);
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
      const float2 x = *reinterpret_cast<const float2*>(red_o + (v * kRows + r) * kHead + col);
      o0 += x.x * scale;
      o1 += x.y * scale;
    }
    const int64_t token = w.q_start + r / a.group_size;
    const int64_t head = static_cast<int64_t>(kv_head) * a.group_size + r % a.group_size;
    const float inv = sum > 0.f ? v_scale / sum : 0.f;
    if (a.num_splits == 1) {
      T* dst = static_cast<T*>(p.out) + token * p.out_token_stride + head * p.out_head_stride + col;
      *reinterpret_cast<uint32_t*>(dst) = attn::pack2<T>(o0 * inv, o1 * inv);
    } else {
      const int64_t slot =
          (static_cast<int64_t>(split) * p.num_tokens + token) * p.num_heads + head;
      *reinterpret_cast<float2*>(a.o_partial + slot * kHead + col) =
          make_float2(o0 * inv, o1 * inv);
      if (col == 0) a.lse_partial[slot] = sum > 0.f ? (m_max + log2f(sum)) * kLn2 : -INFINITY;
    }
  }
}

// grid: (num_seqs * num_kv_heads, num_splits); block: kDecodeWarps warps; dynamic shared memory
// DecodeTile::kSmemBytes. STAGES = 0 takes DecodeTile's ring depth; HEAD_MAJOR = false orders
// grid.x sequence-fastest (kept for benchmarking the two orders against each other).
template <typename T, typename CacheT, int HEAD_SIZE, int STAGES = 0, bool HEAD_MAJOR = true>
__global__ void __launch_bounds__(kDecodeWarps* kWarpSize)
    paged_decode_kernel(const __grid_constant__ AttnArgs a) {
  using Tr = DecodeTile<T, CacheT, HEAD_SIZE, STAGES>;
  constexpr int kStages = Tr::kStages;
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_smem = reinterpret_cast<T*>(smem);  // [16][kRowStride]
  // Let the split-KV merge launch now; it waits (griddepcontrol.wait) for this grid to finish.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  const int num_kv_heads = static_cast<int>(a.p.num_kv_heads);
  const int num_seqs = static_cast<int>(a.p.num_seqs);
  const int seq = HEAD_MAJOR ? blockIdx.x / num_kv_heads : blockIdx.x % num_seqs;
  const int kv_head = HEAD_MAJOR ? blockIdx.x % num_kv_heads : blockIdx.x / num_seqs;
  WorkTile w;
  if (!locate_decode_work(a, seq, w)) return;

  const int warp = threadIdx.x / kWarpSize;
  // [warps][kStages][K, V] rings, then (fp8) each warp's unpacked K and V tiles.
  char* ring = reinterpret_cast<char*>(smem) + Tr::kQBytes + warp * Tr::kWarpBytes;
  auto k_stage = [&](int s) { return ring + s * Tr::kStageBytes; };
  auto v_stage = [&](int s) { return ring + s * Tr::kStageBytes + Tr::kStageBytes / 2; };
  const int first_tile = w.tile_begin + warp;
  const int num_my_tiles =
      first_tile < w.tile_end ? (w.tile_end - first_tile + kDecodeWarps - 1) / kDecodeWarps : 0;
  const bool one_block = a.p.block_size % kDecodeWarpKeys == 0 && w.kv_lo % kDecodeWarpKeys == 0;
  auto load = [&](int i) {  // the warp's i-th tile into ring slot i % kStages
    const int key0 = w.kv_lo + (first_tile + i * kDecodeWarps) * kDecodeWarpKeys;
    load_decode_kv<Tr, CacheT>(a, w, kv_head, key0, one_block, k_stage(i % kStages),
                               v_stage(i % kStages));
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
  for (int i = 0; i < num_my_tiles; ++i) {
    // Refill the slot consumed in the previous iteration (the __syncwarp below ended its reads).
    if (i + kStages - 1 < num_my_tiles) load(i + kStages - 1);
    attn::cp_async_commit();
    attn::cp_async_wait<kStages - 1>();  // tile i has landed (for this lane)
    __syncwarp();                        // ... and for the whole warp
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
    const int k0 = w.kv_lo + (first_tile + i * kDecodeWarps) * kDecodeWarpKeys;
    const bool need_mask = k0 + kDecodeWarpKeys > w.min_row_hi || k0 < w.max_row_lo;
    float s[kDecodeWarpKeys / 8][4];
    compute_scores<Tr, kDecodeWarpKeys>(q_smem, k_tile, s);
    online_softmax<Tr, kDecodeWarpKeys>(s, o, m, l, rb, k0, need_mask, sm, upper_rows);
    accumulate_pv<Tr, kDecodeWarpKeys>(s, v_tile, o);
    __syncwarp();  // every lane is done with slot i % kStages before it is refilled
  }
  attn::cp_async_wait<0>();
  __syncthreads();  // the epilogue's scratch overlays every warp's ring
  decode_merge_warps<Tr, T>(a, w, kv_head, blockIdx.y, o, m, l, sm.v_scale,
                            reinterpret_cast<float*>(smem + Tr::kQBytes));
}

}  // namespace pyorch::kernels
