// The prefill kernel of paged_attention (NHD cache): FlashAttention-2 style, mma.sync m16n8k16,
// for the rows of sequences with q_len * group_size > kPrefillRowsAbove (prefills, chunked prefills
// over a cached prefix, long speculative runs). The decode kernel keeps the decode-like sequences;
// attention.cu launches both and, when the KV range is split, the merge after them.
//
// Work decomposition. Rows are (token, head of the GQA group) pairs, row = t * group_size + g, as
// in paged_attention.cuh, so one KV tile in shared memory serves the whole group. A CTA takes
// kBlockM rows of one sequence and one kv head; grid.x = tiles * num_kv_heads with the kv head
// fastest, grid.y = KV split. The host never reads device data, so grid.x is an upper bound:
// sequence i owns the tiles [base(i), base(i) + ceil(q_len_i * G / kBlockM)) with
//   base(i) = qsl[i] * G / kBlockM + min(i, qsl[i] / L),  L = kPrefillRowsAbove / G + 1,
// which leaves room for every prefill-like sequence (q_len >= kMinQLen) and stays small for a
// batch of many decodes (a CUDA graph captured for mixed batches replays it for pure decodes; its
// CTAs then exit after the search). Within a sequence the CTAs are handed out last rows first:
// under a causal mask those see the most keys, so the long CTAs start in the first wave.
//
// Within a CTA each of kWarps warps owns kMTiles m16 tiles (FlashAttention-2's 128-row CTA of 4
// warps x 32 rows for head sizes <= 128: every K/V fragment read from shared memory feeds two
// mma's, which halves the shared-memory traffic per mma against 16 rows per warp). KV tiles of
// kBlockN keys stream through a kStages ring of cp.async stages with one barrier per tile. Only
// tiles that a warp's rows can see are computed; masks (causal diagonal, sliding-window edge, the
// zero-filled keys past the end) are applied only on tiles that cross a row's bounds. Scores stay
// in the log2 domain with the softmax scale folded into the exp2's FMA.
//
// NOTE(prefill): the tensor-core part is prefill_scores + prefill_pv (Q K^T and P V of one warp's
// rows against one KV tile). paged_prefill_sm90.cuh replaces those two (and the shared-memory
// layout, Tr::*_chunk_offset) with Hopper wgmma and the main loop with a warp-specialized one (a
// producer warpgroup loading, hence the loads' tid / Tr::kLoadThreads), and reuses the rest here;
// attention.cu launches it where its tiles fit, this kernel for the rest (head sizes that are no
// multiple of 64, fp8 caches).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention/paged_attention.cuh"
#include "attention/paged_attention_utils.cuh"
#include "common/dtype.cuh"

namespace pyorch::kernels {

// A sequence is prefill-like when its q_len * group_size rows do not fit the decode path's one
// m16 tile (attention.cu checks that the decode kernel's bound is the same).
constexpr int kPrefillRowsAbove = 16;

// Tile shape per head size. 2 m-tiles per warp need 2 * HEAD_SIZE / 2 fp32 accumulators per
// thread, so head 256 takes one m-tile and 32-key tiles to stay under 255 registers.
// NOTE(prefill): measured on H100 (bf16, head 128, causal 8k): this shape 326 TFLOP/s although
// ptxas spills ~60 bytes (loop-invariant scalars); 2 m-tiles x 32 keys (no spill) 301, 8 warps x
// 1 m-tile 241, 1 m-tile x 4 warps 260, 3 stages at 1 CTA/SM 243.
template <int HEAD_SIZE>
struct PrefillShape {
  static constexpr int kWarps = 4;
  static constexpr int kMTiles = HEAD_SIZE <= 128 ? 2 : 1;
  static constexpr int kBlockN = HEAD_SIZE <= 128 ? 64 : 32;
  static constexpr int kStages = 2;
  static constexpr int kMinBlocksPerSm = 2;  // two CTAs per SM hide each other's softmax
};

// HEAD_SIZE is the real head size; the tiles hold kTileHead dims (attn_tile_head), those past
// HEAD_SIZE zero-filled by the loads and never stored.
template <typename T, typename CacheT, int HEAD_SIZE, class Shape>
struct PrefillTile {
  static constexpr bool kFp8 = std::is_same_v<CacheT, uint8_t>;
  static constexpr int kHeadSize = HEAD_SIZE;
  static constexpr int kTileHead = attn_tile_head(HEAD_SIZE);
  static constexpr int kWarps = Shape::kWarps;
  static constexpr int kMTiles = Shape::kMTiles;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kLoadThreads = kThreads;  // every thread loads
  static constexpr int kWarpRows = 16 * kMTiles;
  static constexpr int kBlockM = kWarps * kWarpRows;
  static constexpr int kBlockN = Shape::kBlockN;
  static constexpr int kStages = Shape::kStages;
  // Rows padded by 16 bytes: the 8 row addresses of an ldmatrix hit 8 distinct 4-bank groups.
  static constexpr int kRowStride = kTileHead + 16 / sizeof(T);
  static constexpr int kChunkElems = 16 / sizeof(T);
  // Cache rows are copied kCopyBytes at a time (8 for an fp8 row of 120 bytes).
  static constexpr int kCacheRowBytes = HEAD_SIZE * static_cast<int>(sizeof(CacheT));
  static constexpr int kCopyBytes = static_cast<int>(paged_attention_copy_bytes(kCacheRowBytes));
  static constexpr int kCacheChunkElems = kCopyBytes / sizeof(CacheT);
  static constexpr int kTTiles = kFp8 ? 1 : kStages;  // fp8 lands raw, is unpacked to one T tile
  static constexpr int kQElems = kBlockM * kRowStride;
  static constexpr int kKvTileElems = kBlockN * kRowStride;
  static constexpr int kRawTileBytes = kFp8 ? kBlockN * kTileHead : 0;
  static constexpr size_t kSmemBytes =
      sizeof(T) * (kQElems + 2 * kTTiles * kKvTileElems) + 2 * kStages * kRawTileBytes;
  static constexpr int kSTiles = kBlockN / 8;    // 8-key n-tiles of a warp's scores
  static constexpr int kOTiles = kTileHead / 8;  // 8-wide n-tiles of a warp's output

  // Byte offsets of 16-byte chunk `col` of Q row `row` / of copy `col` (kCopyBytes) of KV tile
  // row `key` (fp8: raw rows of kTileHead bytes).
  static __device__ __forceinline__ int q_chunk_offset(int row, int col) {
    return row * kRowStride * static_cast<int>(sizeof(T)) + col * 16;
  }
  static __device__ __forceinline__ int kv_chunk_offset(int key, int col) {
    return key * (kFp8 ? kTileHead : kRowStride * static_cast<int>(sizeof(T))) + col * kCopyBytes;
  }

  static_assert(sizeof(T) == 2, "the tensor-core path takes fp16/bf16");
  static_assert(kTileHead % 16 == 0 && kBlockN % 16 == 0, "mma k-steps of 16");
  static_assert(HEAD_SIZE % 8 == 0 && kCacheRowBytes % kCopyBytes == 0,
                "whole 16-byte chunks per query row, whole copies per cache row");
  static_assert(kStages >= 2, "the ring needs a stage to compute and one to fill");
  static_assert(kSmemBytes * Shape::kMinBlocksPerSm <= 227 * 1024, "fits Hopper shared memory");
};

// Smallest q_len of a prefill-like sequence.
__host__ __device__ constexpr int prefill_min_q_len(int group_size) {
  return kPrefillRowsAbove / group_size + 1;
}

// CTAs along grid.x per kv head: an upper bound of the tiles over all prefill-like sequences.
// Host and device: the persistent sm90 kernel walks (tile, kv head) items up to this bound.
template <class Tr>
__host__ __device__ int64_t prefill_grid_tiles(const PagedAttentionParams& p) {
  const int64_t group_size = p.num_heads / p.num_kv_heads;
  const int64_t fit = p.num_tokens / prefill_min_q_len(static_cast<int>(group_size));
  const int64_t max_prefills = p.num_seqs < fit ? p.num_seqs : fit;
  return p.num_tokens * group_size / Tr::kBlockM + max_prefills + 1;
}

template <class Tr>
__device__ __forceinline__ int64_t prefill_tile_base(const int32_t* query_start_loc, int seq,
                                                     int group_size) {
  const int64_t start = query_start_loc[seq];
  return start * group_size / Tr::kBlockM +
         min(static_cast<int64_t>(seq), start / prefill_min_q_len(group_size));
}

// Keys seen by query tokens [t_first, t_last] of a sequence: their union [lo, hi), and the bounds
// inside which every one of them sees every key [max_lo, min_hi).
struct KeySpan {
  int lo, hi, max_lo, min_hi;
};

__device__ __forceinline__ KeySpan key_span(const PagedAttentionParams& p, int first_pos,
                                            int seq_len, int t_first, int t_last) {
  const int win = p.sliding_window;
  KeySpan s;
  s.hi = max(0, p.causal ? min(seq_len, first_pos + t_last + 1) : seq_len);
  s.lo = min(s.hi, win > 0 ? max(0, first_pos + t_first - win + 1) : 0);
  s.min_hi = p.causal ? first_pos + t_first + 1 : seq_len;
  s.max_lo = win > 0 ? first_pos + t_last - win + 1 : 0;
  return s;
}

// Finds the sequence, rows and KV tiles of work item `item` (a grid.x index: tile * num_kv_heads
// + kv head) in KV split blockIdx.y (fills w, kv_head); false: nothing to do.
template <class Tr>
__device__ bool locate_prefill_tile(const AttnArgs& a, int64_t item, WorkTile& w, int& kv_head) {
  const PagedAttentionParams& p = a.p;
  const int G = a.group_size;
  const int64_t tile_idx = item / p.num_kv_heads;
  kv_head = static_cast<int>(item % p.num_kv_heads);
  int lo = 0, hi = static_cast<int>(p.num_seqs) - 1;
  while (lo < hi) {  // the last sequence whose first tile is <= tile_idx
    const int mid = (lo + hi + 1) / 2;
    if (prefill_tile_base<Tr>(p.query_start_loc, mid, G) <= tile_idx)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int64_t base = prefill_tile_base<Tr>(p.query_start_loc, lo, G);
  // Clamped to num_tokens: query_start_loc is device data the host never checked.
  const int64_t q_start = min(static_cast<int64_t>(p.query_start_loc[lo]), p.num_tokens);
  const int64_t q_end = min(static_cast<int64_t>(p.query_start_loc[lo + 1]), p.num_tokens);
  const int q_len = q_end > q_start ? static_cast<int>(q_end - q_start) : 0;
  w.num_rows = q_len * G;
  if (w.num_rows <= kPrefillRowsAbove) return false;  // decode-like: the decode path's
  const int num_row_tiles = (w.num_rows + Tr::kBlockM - 1) / Tr::kBlockM;
  if (tile_idx < base || tile_idx - base >= num_row_tiles) return false;
  w.seq = lo;
  w.q_start = q_start;
  w.row0 = (num_row_tiles - 1 - static_cast<int>(tile_idx - base)) * Tr::kBlockM;
  const int64_t max_len = p.max_blocks_per_seq * p.block_size;
  w.seq_len = static_cast<int>(max(int64_t{0}, min(static_cast<int64_t>(p.seq_lens[lo]), max_len)));
  w.first_pos = w.seq_len - q_len;
  const KeySpan s = key_span(p, w.first_pos, w.seq_len, w.row0 / G,
                             (min(w.row0 + Tr::kBlockM, w.num_rows) - 1) / G);
  w.kv_lo = s.lo;
  w.kv_hi = s.hi;
  const int num_tiles = (w.kv_hi - w.kv_lo + Tr::kBlockN - 1) / Tr::kBlockN;
  const int per_split = (num_tiles + a.num_splits - 1) / a.num_splits;
  w.tile_begin = min(num_tiles, static_cast<int>(blockIdx.y) * per_split);
  w.tile_end = min(num_tiles, w.tile_begin + per_split);
  return true;
}

// cp.async of the CTA's query rows into q_smem (layout: Tr::q_chunk_offset) by the
// Tr::kLoadThreads threads tid = 0.. of the loading warps; padding rows and the dims past the
// head size (Tr::kHeadSize < the tile's) become zeros.
template <class Tr, typename T>
__device__ void load_prefill_q(const AttnArgs& a, const WorkTile& w, int kv_head, T* q_smem,
                               int tid) {
  constexpr int kChunksPerRow = Tr::kOTiles * 8 / Tr::kChunkElems;
  const T* query = static_cast<const T*>(a.p.query);
  for (int c = tid; c < Tr::kBlockM * kChunksPerRow; c += Tr::kLoadThreads) {
    const int r = c / kChunksPerRow;
    const int col = c % kChunksPerRow;
    const int row = w.row0 + r;
    const bool valid = row < w.num_rows &&
                       (Tr::kOTiles * 8 == Tr::kHeadSize || col * Tr::kChunkElems < Tr::kHeadSize);
    const T* src = query;
    if (valid) {
      const int64_t token = w.q_start + row / a.group_size;
      const int64_t head = static_cast<int64_t>(kv_head) * a.group_size + row % a.group_size;
      src += token * a.p.q_token_stride + head * a.p.q_head_stride + col * Tr::kChunkElems;
    }
    attn::cp_async_16(reinterpret_cast<char*>(q_smem) + Tr::q_chunk_offset(r, col), src, valid);
  }
}

// cp.async of keys [k0, k0 + kBlockN) through the block table into T tiles (layout:
// Tr::kv_chunk_offset), or raw [kBlockN][tile head] byte tiles for fp8. Keys >= kv_hi are
// zero-filled and never read: their block-table entries may be stale; so are the tile's dims
// past the head size. Each of the Tr::kLoadThreads loading threads (tid) copies one
// column (Tr::kCopyBytes) of kKeysPerThread consecutive keys, so it looks up one block and then
// steps through it (a warp instruction still reads whole cache rows); a power-of-two block size
// (the usual case) takes a shift.
template <class Tr, typename CacheT>
__device__ __forceinline__ void load_prefill_kv(const AttnArgs& a, const WorkTile& w, int kv_head,
                                                int tile, void* k_dst, void* v_dst, int tid) {
  constexpr int kTileHead = Tr::kOTiles * 8;
  constexpr int kChunksPerRow = kTileHead / Tr::kCacheChunkElems;
  constexpr int kRowsPerPass = Tr::kLoadThreads / kChunksPerRow;
  constexpr int kKeysPerThread = (Tr::kBlockN + kRowsPerPass - 1) / kRowsPerPass;
  static_assert(kRowsPerPass >= 1, "a cache row fits one pass of the loading threads");
  const int r = tid / kChunksPerRow;
  const int col = tid % kChunksPerRow;
  if (r >= kRowsPerPass) return;
  const bool in_row = kTileHead == Tr::kHeadSize || col * Tr::kCacheChunkElems < Tr::kHeadSize;
  const PagedAttentionParams& p = a.p;
  const int32_t* blocks = p.block_table + static_cast<int64_t>(w.seq) * p.block_table_stride;
  const CacheT* k_cache = static_cast<const CacheT*>(p.key_cache);
  const CacheT* v_cache = static_cast<const CacheT*>(p.value_cache);
  const int64_t k_col = kv_head * p.k_head_stride + col * Tr::kCacheChunkElems;
  const int64_t v_col = kv_head * p.v_head_stride + col * Tr::kCacheChunkElems;
  const int block_size = static_cast<int>(p.block_size);
  const int n0 = r * kKeysPerThread;
  int key = w.kv_lo + tile * Tr::kBlockN + n0;
  int block_idx =
      (block_size & (block_size - 1)) == 0 ? key >> (__ffs(block_size) - 1) : key / block_size;
  int offset = key - block_idx * block_size;
  const CacheT* k_src = k_cache;
  const CacheT* v_src = v_cache;
  if (key < w.kv_hi) {
    const int64_t block = blocks[block_idx];
    k_src = k_cache + block * p.k_block_stride + offset * p.k_token_stride + k_col;
    v_src = v_cache + block * p.v_block_stride + offset * p.v_token_stride + v_col;
  }
#pragma unroll
  for (int i = 0; i < kKeysPerThread; ++i) {
    if (Tr::kBlockN % kRowsPerPass != 0 && n0 + i >= Tr::kBlockN) break;
    const bool valid = in_row && key < w.kv_hi;
    const int dst = Tr::kv_chunk_offset(n0 + i, col);
    attn::cp_async<Tr::kCopyBytes>(static_cast<char*>(k_dst) + dst, valid ? k_src : k_cache, valid);
    attn::cp_async<Tr::kCopyBytes>(static_cast<char*>(v_dst) + dst, valid ? v_src : v_cache, valid);
    ++key;
    k_src += p.k_token_stride;
    v_src += p.v_token_stride;
    if (++offset == block_size) {  // into the next cache block
      offset = 0;
      ++block_idx;
      if (key < w.kv_hi) {
        const int64_t block = blocks[block_idx];
        k_src = k_cache + block * p.k_block_stride + k_col;
        v_src = v_cache + block * p.v_block_stride + v_col;
      }
    }
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// s[m-tile][n-tile] = Q K^T (unscaled, fp32) for the warp's kMTiles x 16 rows (q_rows: its first
// row in shared memory) and the tile's kBlockN keys; each K fragment feeds every m-tile.
template <class Tr, typename T>
__device__ __forceinline__ void prefill_scores(const T* q_rows, const T* k_tile,
                                               float (&s)[Tr::kMTiles][Tr::kSTiles][4]) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int j = 0; j < Tr::kSTiles; ++j) {
      s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
    }
  }
  // A (Q): lanes 0-15 give rows 0-15 at column 0, lanes 16-31 the same rows at column 8.
  const T* q_ptr = q_rows + (lane % 16) * Tr::kRowStride + (lane / 16) * 8;
  // B (K^T): matrices (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (8-15, 8-15).
  const T* k_ptr = k_tile + (lane % 8 + (lane / 16) * 8) * Tr::kRowStride + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int kk = 0; kk < Tr::kOTiles / 2; ++kk) {
    uint32_t qa[Tr::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      attn::ldmatrix_x4(qa[mt], q_ptr + mt * 16 * Tr::kRowStride + kk * 16);
    }
#pragma unroll
    for (int nn = 0; nn < Tr::kBlockN / 16; ++nn) {
      uint32_t b[4];
      attn::ldmatrix_x4(b, k_ptr + nn * 16 * Tr::kRowStride + kk * 16);
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        attn::mma_16816<T>(s[mt][2 * nn], qa[mt], b[0], b[1]);
        attn::mma_16816<T>(s[mt][2 * nn + 1], qa[mt], b[2], b[3]);
      }
    }
  }
}

// Sets the scores of keys a row cannot see to -inf. warp_row0: the warp's first row in the
// sequence; k0: the key of s[.][0]. Padding rows (past num_rows) see nothing.
template <class Tr>
__device__ void mask_scores(const AttnArgs& a, const WorkTile& w, int warp_row0, int k0,
                            float (&s)[Tr::kMTiles][Tr::kSTiles][4]) {
  const int lane = threadIdx.x % kWarpSize;
  const PagedAttentionParams& p = a.p;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = warp_row0 + mt * 16 + lane / 4 + 8 * i;
      const int pos = w.first_pos + row / a.group_size;
      int lo = p.sliding_window > 0 ? pos - p.sliding_window + 1 : 0;
      int hi = p.causal ? min(pos + 1, w.seq_len) : w.seq_len;
      if (row >= w.num_rows) lo = hi = 0;
#pragma unroll
      for (int j = 0; j < Tr::kSTiles; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int key = k0 + j * 8 + (lane % 4) * 2 + c;
          if (key < lo || key >= hi) s[mt][j][2 * i + c] = -INFINITY;
        }
      }
    }
  }
}

// Online softmax over one tile: updates the running max m (log2 domain, scaled) and the
// thread-partial sum l of each row, returns in alpha the factor the row's output must be scaled by
// and the probabilities packed as the A fragments of the PV product. score_mul: the factor from s
// to the log2-domain logit (scores already mapped by a soft cap come with 1).
template <class Tr, typename T>
__device__ __forceinline__ void prefill_probs(float (&s)[Tr::kMTiles][Tr::kSTiles][4],
                                              float (&m)[Tr::kMTiles][2],
                                              float (&l)[Tr::kMTiles][2], float score_mul,
                                              float (&alpha)[Tr::kMTiles][2],
                                              uint32_t (&pa)[Tr::kMTiles][Tr::kBlockN / 16][4]) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
    float m_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float row_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < Tr::kSTiles; ++j) {
        row_max = fmaxf(row_max, fmaxf(s[mt][j][2 * i], s[mt][j][2 * i + 1]));
      }
      // The four lanes of a quad hold the same row.
      row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
      row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
      const float m_new = fmaxf(m[mt][i], row_max * score_mul);
      m_use[i] = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: no inf - inf
      alpha[mt][i] = fast_exp2(m[mt][i] - m_use[i]);
      m[mt][i] = m_new;
    }
    // Exponentials packed 16 keys at a time, so the scores die as the fragments fill.
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
      float p[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          p[h][e] = fast_exp2(fmaf(s[mt][2 * kk + h][e], score_mul, -m_use[e / 2]));
          sum[e / 2] += p[h][e];
        }
      }
      pa[mt][kk][0] = attn::pack2<T>(p[0][0], p[0][1]);
      pa[mt][kk][1] = attn::pack2<T>(p[0][2], p[0][3]);
      pa[mt][kk][2] = attn::pack2<T>(p[1][0], p[1][1]);
      pa[mt][kk][3] = attn::pack2<T>(p[1][2], p[1][3]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) l[mt][i] = l[mt][i] * alpha[mt][i] + sum[i];
  }
}

// o[m-tile] *= alpha, row by row (the C-fragment rows lane / 4 and lane / 4 + 8).
template <class Tr, int N>
__device__ __forceinline__ void prefill_rescale(float (&o)[Tr::kMTiles][N][4],
                                                const float (&alpha)[Tr::kMTiles][2]) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      o[mt][j][0] *= alpha[mt][0];
      o[mt][j][1] *= alpha[mt][0];
      o[mt][j][2] *= alpha[mt][1];
      o[mt][j][3] *= alpha[mt][1];
    }
  }
}

// prefill_probs, then o rescaled by alpha.
template <class Tr, typename T>
__device__ __forceinline__ void prefill_softmax(float (&s)[Tr::kMTiles][Tr::kSTiles][4],
                                                float (&o)[Tr::kMTiles][Tr::kOTiles][4],
                                                float (&m)[Tr::kMTiles][2],
                                                float (&l)[Tr::kMTiles][2], float score_mul,
                                                uint32_t (&pa)[Tr::kMTiles][Tr::kBlockN / 16][4]) {
  float alpha[Tr::kMTiles][2];
  prefill_probs<Tr, T>(s, m, l, score_mul, alpha, pa);
  prefill_rescale<Tr>(o, alpha);
}

// o[m-tile] += P V over the tile's keys; each V fragment feeds every m-tile.
template <class Tr, typename T>
__device__ __forceinline__ void prefill_pv(const uint32_t (&pa)[Tr::kMTiles][Tr::kBlockN / 16][4],
                                           const T* v_tile,
                                           float (&o)[Tr::kMTiles][Tr::kOTiles][4]) {
  const int lane = threadIdx.x % kWarpSize;
  // B (V [key][d], read transposed): matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7),
  // (keys 0-7, d 8-15), (keys 8-15, d 8-15).
  const T* v_ptr = v_tile + (lane % 8 + ((lane / 8) % 2) * 8) * Tr::kRowStride + (lane / 16) * 8;
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
#pragma unroll
    for (int dd = 0; dd < Tr::kOTiles / 2; ++dd) {
      uint32_t b[4];
      attn::ldmatrix_x4_trans(b, v_ptr + kk * 16 * Tr::kRowStride + dd * 16);
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        attn::mma_16816<T>(o[mt][2 * dd], pa[mt][kk], b[0], b[1]);
        attn::mma_16816<T>(o[mt][2 * dd + 1], pa[mt][kk], b[2], b[3]);
      }
    }
  }
}

// Normalizes and writes the warp's rows: to `out` (and their log-sum-exp to p.lse when set), or
// to the split's partial slot (rows of Tr::kHeadSize floats) with its log-sum-exp (natural log;
// -inf and zeros for a row that saw no key), as merge_split_kv_kernel expects. The n-tiles past
// the head size (a padded tile) are not stored.
template <class Tr, typename T>
__device__ void store_prefill_rows(const AttnArgs& a, const WorkTile& w, int kv_head, int warp_row0,
                                   const float (&o)[Tr::kMTiles][Tr::kOTiles][4],
                                   const float (&m)[Tr::kMTiles][2],
                                   const float (&l)[Tr::kMTiles][2], float v_scale) {
  static_assert(Tr::kHeadSize % 8 == 0, "whole n-tiles of the output are stored");
  constexpr int kStoredTiles = Tr::kHeadSize / 8;
  const int lane = threadIdx.x % kWarpSize;
  const PagedAttentionParams& p = a.p;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float sum = l[mt][i];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int row = warp_row0 + mt * 16 + lane / 4 + 8 * i;
      if (row >= w.num_rows) continue;
      const int64_t token = w.q_start + row / a.group_size;
      const int64_t head = static_cast<int64_t>(kv_head) * a.group_size + row % a.group_size;
      const float inv = sum > 0.f ? v_scale / sum : 0.f;
      if (a.num_splits == 1) {
        T* dst = static_cast<T*>(p.out) + token * p.out_token_stride + head * p.out_head_stride +
                 (lane % 4) * 2;
#pragma unroll
        for (int j = 0; j < kStoredTiles; ++j) {
          *reinterpret_cast<uint32_t*>(dst + j * 8) =
              attn::pack2<T>(o[mt][j][2 * i] * inv, o[mt][j][2 * i + 1] * inv);
        }
        if (p.lse != nullptr && lane % 4 == 0) {
          p.lse[head * p.lse_head_stride + token] =
              sum > 0.f ? (m[mt][i] + log2f(sum)) * kLn2 : -INFINITY;
        }
      } else {
        const int64_t slot = (blockIdx.y * p.num_tokens + token) * p.num_heads + head;
        float* dst = a.o_partial + slot * Tr::kHeadSize + (lane % 4) * 2;
#pragma unroll
        for (int j = 0; j < kStoredTiles; ++j) {
          *reinterpret_cast<float2*>(dst + j * 8) =
              make_float2(o[mt][j][2 * i] * inv, o[mt][j][2 * i + 1] * inv);
        }
        if (lane % 4 == 0) {
          a.lse_partial[slot] = sum > 0.f ? (m[mt][i] + log2f(sum)) * kLn2 : -INFINITY;
        }
      }
    }
  }
}

template <typename T, typename CacheT, int HEAD_SIZE, class Shape>
__global__ void __launch_bounds__(Shape::kWarps* kWarpSize, Shape::kMinBlocksPerSm)
    paged_prefill_kernel(const __grid_constant__ AttnArgs a) {
  using Tr = PrefillTile<T, CacheT, HEAD_SIZE, Shape>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_smem = reinterpret_cast<T*>(smem);               // [kBlockM][kRowStride]
  T* k_smem = q_smem + Tr::kQElems;                     // [kTTiles][kBlockN][kRowStride]
  T* v_smem = k_smem + Tr::kTTiles * Tr::kKvTileElems;  // [kTTiles][kBlockN][kRowStride]
  // fp8 only: raw K stages then raw V stages, each [kBlockN][HEAD_SIZE] bytes.
  uint8_t* raw = reinterpret_cast<uint8_t*>(v_smem + Tr::kTTiles * Tr::kKvTileElems);

  WorkTile w;
  int kv_head;
  if (!locate_prefill_tile<Tr>(a, blockIdx.x, w, kv_head)) return;
  auto k_dst = [&](int stage) -> void* {
    return Tr::kFp8 ? static_cast<void*>(raw + stage * Tr::kRawTileBytes)
                    : static_cast<void*>(k_smem + stage * Tr::kKvTileElems);
  };
  auto v_dst = [&](int stage) -> void* {
    return Tr::kFp8 ? static_cast<void*>(raw + (Tr::kStages + stage) * Tr::kRawTileBytes)
                    : static_cast<void*>(v_smem + stage * Tr::kKvTileElems);
  };
  // Prologue: Q rides in the first group; then kStages - 1 tiles in flight.
  load_prefill_q<Tr>(a, w, kv_head, q_smem, threadIdx.x);
#pragma unroll
  for (int st = 0; st < Tr::kStages - 1; ++st) {
    if (w.tile_begin + st < w.tile_end) {
      load_prefill_kv<Tr, CacheT>(a, w, kv_head, w.tile_begin + st, k_dst(st), v_dst(st),
                                  threadIdx.x);
    }
    attn::cp_async_commit();  // possibly empty: keeps the group count uniform
  }

  const int warp = threadIdx.x / kWarpSize;
  const int G = a.group_size;
  const int warp_row0 = w.row0 + warp * Tr::kWarpRows;
  const bool warp_active = warp_row0 < w.num_rows;  // warp-uniform
  const KeySpan ks = key_span(a.p, w.first_pos, w.seq_len, warp_row0 / G,
                              (min(warp_row0 + Tr::kWarpRows, w.num_rows) - 1) / G);
  const ScoreMap sm = make_score_map<Tr>(a.p);
  // Plain scores take the scale inside the exp2's FMA; a soft cap (or a scale <= 0, where -inf
  // masks would flip) maps them first.
  const bool map_first = sm.soft_cap || !(sm.mul > 0.f);
  const float score_mul = map_first ? 1.f : sm.mul;
  float o[Tr::kMTiles][Tr::kOTiles][4] = {};
  float m[Tr::kMTiles][2];
  float l[Tr::kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }

  int stage = 0;
  for (int tile = w.tile_begin; tile < w.tile_end; ++tile) {
    attn::cp_async_wait<Tr::kStages - 2>();  // this tile (and Q) landed for this thread
    __syncthreads();  // ... for every thread; and every warp is done with the stage refilled next
    const int next = tile + Tr::kStages - 1;
    const int next_stage = stage == 0 ? Tr::kStages - 1 : stage - 1;
    if (next < w.tile_end) {
      load_prefill_kv<Tr, CacheT>(a, w, kv_head, next, k_dst(next_stage), v_dst(next_stage),
                                  threadIdx.x);
    }
    attn::cp_async_commit();
    if constexpr (Tr::kFp8) {
      unpack_fp8_tile<Tr>(raw + stage * Tr::kRawTileBytes, k_smem);
      unpack_fp8_tile<Tr>(raw + (Tr::kStages + stage) * Tr::kRawTileBytes, v_smem);
      __syncthreads();
    }
    const int t_stage = Tr::kFp8 ? 0 : stage;
    const int k0 = w.kv_lo + tile * Tr::kBlockN;
    if (warp_active && k0 < ks.hi && k0 + Tr::kBlockN > ks.lo) {
      float s[Tr::kMTiles][Tr::kSTiles][4];
      prefill_scores<Tr>(q_smem + warp * Tr::kWarpRows * Tr::kRowStride,
                         k_smem + t_stage * Tr::kKvTileElems, s);
      if (map_first) {
#pragma unroll
        for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
          for (int j = 0; j < Tr::kSTiles; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float x = s[mt][j][e] * sm.mul;
              s[mt][j][e] = sm.soft_cap ? tanhf(x) * sm.cap_log2 : x;
            }
          }
        }
      }
      if (k0 + Tr::kBlockN > ks.min_hi || k0 < ks.max_lo) mask_scores<Tr>(a, w, warp_row0, k0, s);
      uint32_t pa[Tr::kMTiles][Tr::kBlockN / 16][4];
      prefill_softmax<Tr, T>(s, o, m, l, score_mul, pa);
      prefill_pv<Tr>(pa, v_smem + t_stage * Tr::kKvTileElems, o);
    }
    stage = stage + 1 == Tr::kStages ? 0 : stage + 1;
  }
  attn::cp_async_wait<0>();  // no copy may land after the CTA exits
  if (warp_active) store_prefill_rows<Tr, T>(a, w, kv_head, warp_row0, o, m, l, sm.v_scale);
}

}  // namespace pyorch::kernels
