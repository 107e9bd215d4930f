// pyorch's default paged attention (NHD cache): one tensor-core kernel for mixed batches of
// prefills, chunked prefills and decodes, with an optional split of the KV range across CTAs.
//
// Work decomposition. For a kv head, the query rows of sequence i are the pairs (token t, head g
// of the GQA group), flattened as row = t * group_size + g, so one read of a KV tile serves every
// query head of the group; a decode step of a GQA model is one CTA of group_size rows. A CTA takes
// kBlockM consecutive rows of one sequence (grid.x), one kv head (grid.y) and one KV split
// (grid.z). grid.x is sized without reading device data: sequence i owns the CTAs
// [qsl[i] * G / kBlockM + i, qsl[i+1] * G / kBlockM + i + 1), which covers its
// ceil(q_len * G / kBlockM) tiles; a CTA finds its sequence by binary search and exits when it
// has no rows. Within a CTA each warp owns 16 rows and runs FlashAttention-2 style online softmax
// over KV tiles of kBlockN keys, double-buffered in shared memory with cp.async (fp8 tiles are
// unpacked to T in shared memory after they land). With num_splits > 1 each CTA covers a slice of
// the KV tiles and writes a normalized partial output and its log-sum-exp; merge_split_kv_kernel
// (merge_attn_states.cuh) combines them.
//
// Decode CTAs. A CTA whose rows fit one m16 tile (a decode step with group_size <= 16, or a few
// speculative tokens) would leave three warps idle and one warp computing every KV tile, which
// makes it compute-bound. Such a CTA (a CTA-uniform, run-time choice, so CUDA graphs captured for
// mixed batches take it too) gives every warp the same 16 rows and a quarter of each KV tile's
// keys; each warp keeps its own running max, sum and output, and the four are merged through
// shared memory at the end (decode_store_rows).
//
// NOTE(decode): attention.cu now sends the sequences with at most 16 rows to
// paged_decode_kernel (paged_decode.cuh: per-warp cp.async rings, one CTA per (sequence, kv head,
// split)) and the rest to paged_prefill_kernel; this file keeps the shared building blocks
// (AttnArgs, WorkTile, compute_scores, online_softmax, accumulate_pv) that those kernels use.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention/paged_attention_utils.cuh"
#include "common/check.cuh"
#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "pyorch/attention.h"

namespace pyorch::kernels {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kAttnWarps = 4;
constexpr int kAttnBlockM = 16 * kAttnWarps;  // query rows per CTA: one m16 mma tile per warp

// Keys per KV tile: 64, halved for head 256 to keep the O accumulators in registers.
constexpr int attn_block_n(int head_size) { return head_size <= 128 ? 64 : 32; }

template <typename T, typename CacheT, int HEAD_SIZE>
struct AttnTile {
  static constexpr bool kFp8 = std::is_same_v<CacheT, uint8_t>;
  static constexpr int kThreads = kAttnWarps * kWarpSize;
  static constexpr int kBlockM = kAttnBlockM;
  static constexpr int kBlockN = attn_block_n(HEAD_SIZE);
  static constexpr int kStages = 2;  // KV tiles in flight: load tile j+1 while computing tile j
  // Padded shared-memory row (elements): consecutive rows shift by 16 bytes, so the 8 row
  // addresses of one ldmatrix land in 8 distinct 4-bank groups for every supported head size.
  static constexpr int kRowStride = HEAD_SIZE + 16 / sizeof(T);
  static constexpr int kChunkElems = 16 / sizeof(T);            // T per 16-byte copy
  static constexpr int kCacheChunkElems = 16 / sizeof(CacheT);  // cache elements per copy
  static constexpr int kTTiles = kFp8 ? 1 : kStages;  // fp8 lands raw and is unpacked in place
  static constexpr int kQElems = kBlockM * kRowStride;
  static constexpr int kKvTileElems = kBlockN * kRowStride;
  static constexpr int kRawTileBytes = kFp8 ? kBlockN * HEAD_SIZE : 0;
  static constexpr size_t kSmemBytes =
      sizeof(T) * (kQElems + 2 * kTTiles * kKvTileElems) + 2 * kStages * kRawTileBytes;
  static constexpr int kSTiles = kBlockN / 8;    // 8-key n-tiles of the scores, per warp
  static constexpr int kOTiles = HEAD_SIZE / 8;  // 8-wide n-tiles of the output, per warp

  static_assert(sizeof(T) == 2, "the tensor-core path takes fp16/bf16");
  static_assert(HEAD_SIZE % 16 == 0 && kBlockN % 16 == 0, "mma k-steps of 16");
  static_assert((kRowStride * sizeof(T)) % 16 == 0, "16-byte aligned shared-memory rows");
  static_assert(HEAD_SIZE % kCacheChunkElems == 0, "whole 16-byte chunks per cache row");
  static_assert(kStages == 2, "the pipeline below alternates two stages");
  static_assert(kSmemBytes <= 227 * 1024, "fits Hopper shared memory");
};

// Kernel arguments: the C API params plus what the launcher derives from them.
struct AttnArgs {
  PagedAttentionParams p;
  int group_size;      // num_heads / num_kv_heads
  int num_splits;      // KV slices per (tile, kv head); 1: write `out` directly
  float* o_partial;    // [num_splits, num_tokens, num_heads, head_size] when num_splits > 1
  float* lse_partial;  // [num_splits, num_tokens, num_heads] when num_splits > 1
  // Leave the sequences with 1..16 query rows (q_len * group_size) to paged_decode_kernel.
  bool skip_decode_seqs;
};

// What one CTA computes: rows [row0, row0 + kBlockM) of sequence `seq` (clipped to num_rows)
// against KV tiles [tile_begin, tile_end) of the key range [kv_lo, kv_hi) its rows can see.
struct WorkTile {
  int seq;
  int64_t q_start;  // first query row of the sequence in query/out
  int num_rows;     // q_len * group_size
  int row0;
  int first_pos;    // position of the sequence's first query token
  int seq_len;
  int kv_lo, kv_hi;
  int min_row_hi;   // smallest exclusive key bound over the CTA's rows
  int max_row_lo;   // largest inclusive key bound over the CTA's rows
  int tile_begin, tile_end;
};

// Per-thread visible key range [lo, hi) of its two accumulator rows (lane/4 and lane/4 + 8).
struct RowBounds {
  int lo[2];
  int hi[2];
};

// Scores in the log2 domain: x = q.k * mul, or tanh(q.k * mul) * cap_log2 with a soft cap.
struct ScoreMap {
  float mul;
  float cap_log2;
  bool soft_cap;
  float v_scale;
};

__device__ __forceinline__ int64_t seq_tile_base(const int32_t* query_start_loc, int seq,
                                                 int group_size) {
  return static_cast<int64_t>(query_start_loc[seq]) * group_size / kAttnBlockM + seq;
}

template <int BLOCK_N>
__device__ bool locate_work_tile(const AttnArgs& a, WorkTile& w) {
  const PagedAttentionParams& p = a.p;
  const int64_t bid = blockIdx.x;
  const int G = a.group_size;
  int lo = 0, hi = static_cast<int>(p.num_seqs) - 1;
  while (lo < hi) {  // the last sequence whose first CTA is <= bid
    const int mid = (lo + hi + 1) / 2;
    if (seq_tile_base(p.query_start_loc, mid, G) <= bid) lo = mid; else hi = mid - 1;
  }
  const int64_t base = seq_tile_base(p.query_start_loc, lo, G);
  // Clamp to num_tokens: query_start_loc is device data the host never checked.
  const int64_t q_start = min(static_cast<int64_t>(p.query_start_loc[lo]), p.num_tokens);
  const int64_t q_end = min(static_cast<int64_t>(p.query_start_loc[lo + 1]), p.num_tokens);
  const int q_len = q_end > q_start ? static_cast<int>(q_end - q_start) : 0;
  if (bid < base || (bid - base) * kAttnBlockM >= static_cast<int64_t>(q_len) * G) return false;
  if (a.skip_decode_seqs && q_len * G <= 16) return false;  // paged_decode_kernel's
  w.seq = lo;
  w.q_start = q_start;
  w.num_rows = q_len * G;
  w.row0 = static_cast<int>(bid - base) * kAttnBlockM;
  const int64_t max_len = p.max_blocks_per_seq * p.block_size;
  w.seq_len = static_cast<int>(max(int64_t{0}, min(static_cast<int64_t>(p.seq_lens[lo]), max_len)));
  w.first_pos = w.seq_len - q_len;
  const int t_first = w.row0 / G;
  const int t_last = (min(w.row0 + kAttnBlockM, w.num_rows) - 1) / G;
  const int win = p.sliding_window;
  w.min_row_hi = p.causal ? w.first_pos + t_first + 1 : w.seq_len;
  w.max_row_lo = win > 0 ? w.first_pos + t_last - win + 1 : 0;
  w.kv_hi = max(0, p.causal ? min(w.seq_len, w.first_pos + t_last + 1) : w.seq_len);
  w.kv_lo = min(w.kv_hi, win > 0 ? max(0, w.first_pos + t_first - win + 1) : 0);
  const int num_tiles = (w.kv_hi - w.kv_lo + BLOCK_N - 1) / BLOCK_N;
  const int per_split = (num_tiles + a.num_splits - 1) / a.num_splits;
  w.tile_begin = min(num_tiles, static_cast<int>(blockIdx.z) * per_split);
  w.tile_end = min(num_tiles, w.tile_begin + per_split);
  return true;
}

// row_block: which 16-row slice of the CTA's rows this warp holds (its warp index, or 0 on the
// decode path where all warps hold the same rows).
template <class Tr>
__device__ RowBounds row_bounds(const AttnArgs& a, const WorkTile& w, int row_block) {
  RowBounds rb;
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = w.row0 + row_block * 16 + lane / 4 + 8 * i;
    if (row < w.num_rows) {
      const int pos = w.first_pos + row / a.group_size;
      rb.hi[i] = a.p.causal ? min(pos + 1, w.seq_len) : w.seq_len;
      rb.lo[i] = a.p.sliding_window > 0 ? pos - a.p.sliding_window + 1 : 0;
    } else {  // a padding row of the tile: sees nothing
      rb.hi[i] = 0;
      rb.lo[i] = 1;
    }
  }
  return rb;
}

template <class Tr>
__device__ ScoreMap make_score_map(const PagedAttentionParams& p) {
  float k_scale = 1.f, v_scale = 1.f;
  if constexpr (Tr::kFp8) {
    if (p.k_scale != nullptr) k_scale = *p.k_scale;
    if (p.v_scale != nullptr) v_scale = *p.v_scale;
  }
  const float scale = p.scale * k_scale;
  ScoreMap sm;
  sm.soft_cap = p.logits_soft_cap > 0.f;
  sm.mul = sm.soft_cap ? scale / p.logits_soft_cap : scale * kLog2e;
  sm.cap_log2 = p.logits_soft_cap * kLog2e;
  sm.v_scale = v_scale;
  return sm;
}

// cp.async of the CTA's query rows into q_smem [kBlockM][kRowStride]; padding rows become zeros.
template <class Tr, typename T>
__device__ void load_q_tile(const AttnArgs& a, const WorkTile& w, T* q_smem) {
  constexpr int kChunksPerRow = Tr::kOTiles * 8 / Tr::kChunkElems;
  const T* query = static_cast<const T*>(a.p.query);
  for (int c = threadIdx.x; c < Tr::kBlockM * kChunksPerRow; c += Tr::kThreads) {
    const int r = c / kChunksPerRow;
    const int col = c % kChunksPerRow;
    const int row = w.row0 + r;
    const bool valid = row < w.num_rows;
    const T* src = query;
    if (valid) {
      const int64_t token = w.q_start + row / a.group_size;
      const int64_t head = static_cast<int64_t>(blockIdx.y) * a.group_size + row % a.group_size;
      src = query + token * a.p.q_token_stride + head * a.p.q_head_stride + col * Tr::kChunkElems;
    }
    attn::cp_async_16(q_smem + r * Tr::kRowStride + col * Tr::kChunkElems, src, valid);
  }
}

// cp.async of keys [k0, k0 + kBlockN) through the block table. Destinations are padded T tiles,
// or raw [kBlockN][HEAD_SIZE] byte tiles for fp8. Keys >= kv_hi are zero-filled, never read:
// their block-table entries may be stale.
template <class Tr, typename CacheT>
__device__ void load_kv_tile(const AttnArgs& a, const WorkTile& w, int tile, void* k_dst,
                             void* v_dst) {
  constexpr int kHeadSize = Tr::kOTiles * 8;
  constexpr int kChunksPerRow = kHeadSize / Tr::kCacheChunkElems;
  constexpr int kDstRowBytes = Tr::kFp8 ? kHeadSize : Tr::kRowStride * 2;
  const PagedAttentionParams& p = a.p;
  const CacheT* k_cache = static_cast<const CacheT*>(p.key_cache);
  const CacheT* v_cache = static_cast<const CacheT*>(p.value_cache);
  const int32_t* blocks = p.block_table + static_cast<int64_t>(w.seq) * p.block_table_stride;
  const int block_size = static_cast<int>(p.block_size);
  const int64_t kv_head = blockIdx.y;
  const int k0 = w.kv_lo + tile * Tr::kBlockN;
  for (int c = threadIdx.x; c < Tr::kBlockN * kChunksPerRow; c += Tr::kThreads) {
    const int n = c / kChunksPerRow;
    const int col = c % kChunksPerRow;
    const int key = k0 + n;
    const bool valid = key < w.kv_hi;
    const CacheT* k_src = k_cache;
    const CacheT* v_src = v_cache;
    if (valid) {
      const int64_t block = blocks[key / block_size];
      const int64_t offset = key % block_size;
      const int64_t elem = col * Tr::kCacheChunkElems;
      k_src += block * p.k_block_stride + offset * p.k_token_stride + kv_head * p.k_head_stride + elem;
      v_src += block * p.v_block_stride + offset * p.v_token_stride + kv_head * p.v_head_stride + elem;
    }
    const int dst_offset = n * kDstRowBytes + col * 16;
    attn::cp_async_16(static_cast<char*>(k_dst) + dst_offset, k_src, valid);
    attn::cp_async_16(static_cast<char*>(v_dst) + dst_offset, v_src, valid);
  }
}

// raw fp8 tile [kBlockN][HEAD_SIZE] -> padded T tile [kBlockN][kRowStride] (scale applied later).
template <class Tr, typename T>
__device__ void unpack_fp8_tile(const uint8_t* raw, T* dst) {
  constexpr int kHeadSize = Tr::kOTiles * 8;
  constexpr int kChunksPerRow = kHeadSize / 16;
  for (int c = threadIdx.x; c < Tr::kBlockN * kChunksPerRow; c += Tr::kThreads) {
    const int n = c / kChunksPerRow;
    const int col = c % kChunksPerRow;
    const uint4 in = *reinterpret_cast<const uint4*>(raw + n * kHeadSize + col * 16);
    uint4* out = reinterpret_cast<uint4*>(dst + n * Tr::kRowStride + col * 16);
    attn::fp8x16_to<T>(in, out[0], out[1]);
  }
}

// s[16 rows][NKEYS keys] = Q K^T (unscaled), fp32. q_rows: the warp's first query row in shared
// memory; k_rows: its first key row.
template <class Tr, int NKEYS, typename T>
__device__ void compute_scores(const T* q_rows, const T* k_rows, float (&s)[NKEYS / 8][4]) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int j = 0; j < NKEYS / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  // A (Q, row-major): lanes 0-15 give rows 0-15 at column 0, lanes 16-31 the same rows at 8.
  const T* q_ptr = q_rows + (lane % 16) * Tr::kRowStride + (lane / 16) * 8;
  // B (K^T, "col"): matrices (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (8-15, 8-15).
  const T* k_ptr = k_rows + (lane % 8 + (lane / 16) * 8) * Tr::kRowStride + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int kk = 0; kk < Tr::kOTiles / 2; ++kk) {
    uint32_t a[4];
    attn::ldmatrix_x4(a, q_ptr + kk * 16);
#pragma unroll
    for (int nn = 0; nn < NKEYS / 16; ++nn) {
      uint32_t b[4];
      attn::ldmatrix_x4(b, k_ptr + nn * 16 * Tr::kRowStride + kk * 16);
      attn::mma_16816<T>(s[2 * nn], a, b[0], b[1]);
      attn::mma_16816<T>(s[2 * nn + 1], a, b[2], b[3]);
    }
  }
}

// Scales/caps/masks the scores, updates the running max m and (thread-partial) sum l of both
// rows, rescales o, and leaves the probabilities exp2(x - m) in s. k0: the key of s[0].
// upper_rows = false (warp-uniform): the tile's rows 8-15 are padding (a decode CTA of <= 8 rows)
// and get probability 0 without the work. o is rescaled only when some row's max moved, which
// a long sequence's scores soon stop doing.
template <class Tr, int NKEYS>
__device__ __forceinline__ void online_softmax(float (&s)[NKEYS / 8][4],
                                               float (&o)[Tr::kOTiles][4], float (&m)[2],
                                               float (&l)[2], const RowBounds& rb, int k0,
                                               bool need_mask, const ScoreMap& sm,
                                               bool upper_rows = true) {
  const int lane = threadIdx.x % kWarpSize;
  float alpha[2] = {1.f, 1.f};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (i == 1 && !upper_rows) {
#pragma unroll
      for (int j = 0; j < NKEYS / 8; ++j) s[j][2] = s[j][3] = 0.f;
      break;
    }
    float row_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < NKEYS / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float x = s[j][2 * i + c];
        x = sm.soft_cap ? tanhf(x * sm.mul) * sm.cap_log2 : x * sm.mul;
        const int key = k0 + j * 8 + (lane % 4) * 2 + c;
        if (need_mask && (key < rb.lo[i] || key >= rb.hi[i])) x = -INFINITY;
        s[j][2 * i + c] = x;
        row_max = fmaxf(row_max, x);
      }
    }
    // The four lanes of a quad hold the same row.
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
    const float m_new = fmaxf(m[i], row_max);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: avoid inf - inf
    alpha[i] = exp2f(m[i] - m_use);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < NKEYS / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float p = exp2f(s[j][2 * i + c] - m_use);
        s[j][2 * i + c] = p;
        sum += p;
      }
    }
    l[i] = l[i] * alpha[i] + sum;
    m[i] = m_new;
  }
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int j = 0; j < Tr::kOTiles; ++j) {
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
    }
  }
}

// o[16 rows][HEAD_SIZE] += P V over NKEYS keys from v_rows; the score accumulators are reused as
// the A operand in registers.
template <class Tr, int NKEYS, typename T>
__device__ void accumulate_pv(const float (&s)[NKEYS / 8][4], const T* v_rows,
                              float (&o)[Tr::kOTiles][4]) {
  const int lane = threadIdx.x % kWarpSize;
  // B (V, [key][d] row-major, read transposed): matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7),
  // (keys 0-7, d 8-15), (keys 8-15, d 8-15).
  const T* v_ptr = v_rows + (lane % 8 + ((lane / 8) % 2) * 8) * Tr::kRowStride + (lane / 16) * 8;
#pragma unroll
  for (int kk = 0; kk < NKEYS / 16; ++kk) {
    const uint32_t a[4] = {attn::pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                           attn::pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                           attn::pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                           attn::pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int dd = 0; dd < Tr::kOTiles / 2; ++dd) {
      uint32_t b[4];
      attn::ldmatrix_x4_trans(b, v_ptr + kk * 16 * Tr::kRowStride + dd * 16);
      attn::mma_16816<T>(o[2 * dd], a, b[0], b[1]);
      attn::mma_16816<T>(o[2 * dd + 1], a, b[2], b[3]);
    }
  }
}

// Normalizes and writes this thread's rows: to `out`, or to the split's partial slot with its
// log-sum-exp (natural log; -inf for a row that saw no key).
template <class Tr, typename T>
__device__ void store_rows(const AttnArgs& a, const WorkTile& w, const float (&o)[Tr::kOTiles][4],
                           const float (&m)[2], const float (&l)[2], float v_scale) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const PagedAttentionParams& p = a.p;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float sum = l[i];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = w.row0 + warp * 16 + lane / 4 + 8 * i;
    if (row >= w.num_rows) continue;
    const int64_t token = w.q_start + row / a.group_size;
    const int64_t head = static_cast<int64_t>(blockIdx.y) * a.group_size + row % a.group_size;
    const float inv = sum > 0.f ? v_scale / sum : 0.f;
    if (a.num_splits == 1) {
      T* dst = static_cast<T*>(p.out) + token * p.out_token_stride + head * p.out_head_stride +
               (lane % 4) * 2;
#pragma unroll
      for (int j = 0; j < Tr::kOTiles; ++j) {
        *reinterpret_cast<uint32_t*>(dst + j * 8) =
            attn::pack2<T>(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
      }
    } else {
      const int64_t slot = (blockIdx.z * p.num_tokens + token) * p.num_heads + head;
      float* dst = a.o_partial + slot * (Tr::kOTiles * 8) + (lane % 4) * 2;
#pragma unroll
      for (int j = 0; j < Tr::kOTiles; ++j) {
        *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
      }
      if (lane % 4 == 0) a.lse_partial[slot] = sum > 0.f ? (m[i] + log2f(sum)) * kLn2 : -INFINITY;
    }
  }
}

// Keys of each KV tile one warp takes on the decode path (0: the head size has no decode path,
// its tiles are too narrow to give every warp an mma k-step of 16 keys).
template <class Tr>
constexpr int decode_warp_keys() {
  return Tr::kBlockN / kAttnWarps >= 16 ? Tr::kBlockN / kAttnWarps : 0;
}

// Decode-path epilogue: merges the four warps' (max, sum, output) of the same 16 rows through
// shared memory `scratch` (the KV stages, free once the loop is done), normalizes, and writes the
// rows to `out`, or to the split's partial slot with its log-sum-exp, as store_rows does.
template <class Tr, typename T>
__device__ void decode_store_rows(const AttnArgs& a, const WorkTile& w,
                                  const float (&o)[Tr::kOTiles][4], const float (&m)[2],
                                  const float (&l)[2], float v_scale, float* scratch) {
  constexpr int kHead = Tr::kOTiles * 8;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  float* red_o = scratch;                             // [warps][16][kHead]
  float* red_m = red_o + kAttnWarps * 16 * kHead;     // [warps][16]
  float* red_l = red_m + kAttnWarps * 16;             // [warps][16]
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float sum = l[i];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int r = lane / 4 + 8 * i;
    float* dst = red_o + (warp * 16 + r) * kHead + (lane % 4) * 2;
#pragma unroll
    for (int j = 0; j < Tr::kOTiles; ++j) {
      *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[j][2 * i], o[j][2 * i + 1]);
    }
    if (lane % 4 == 0) {
      red_m[warp * 16 + r] = m[i];
      red_l[warp * 16 + r] = sum;
    }
  }
  __syncthreads();
  const PagedAttentionParams& p = a.p;
  const int rows = min(16, w.num_rows - w.row0);
  for (int idx = threadIdx.x; idx < rows * (kHead / 2); idx += Tr::kThreads) {
    const int r = idx / (kHead / 2);
    const int col = (idx % (kHead / 2)) * 2;
    float m_max = -INFINITY;
#pragma unroll
    for (int v = 0; v < kAttnWarps; ++v) m_max = fmaxf(m_max, red_m[v * 16 + r]);
    const float m_use = m_max == -INFINITY ? 0.f : m_max;
    float sum = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int v = 0; v < kAttnWarps; ++v) {
      const float scale = exp2f(red_m[v * 16 + r] - m_use);
      sum += red_l[v * 16 + r] * scale;
      const float2 x = *reinterpret_cast<const float2*>(red_o + (v * 16 + r) * kHead + col);
      o0 += x.x * scale;
      o1 += x.y * scale;
    }
    const int row = w.row0 + r;
    const int64_t token = w.q_start + row / a.group_size;
    const int64_t head = static_cast<int64_t>(blockIdx.y) * a.group_size + row % a.group_size;
    const float inv = sum > 0.f ? v_scale / sum : 0.f;
    if (a.num_splits == 1) {
      T* dst = static_cast<T*>(p.out) + token * p.out_token_stride + head * p.out_head_stride + col;
      *reinterpret_cast<uint32_t*>(dst) = attn::pack2<T>(o0 * inv, o1 * inv);
    } else {
      const int64_t slot = (blockIdx.z * p.num_tokens + token) * p.num_heads + head;
      *reinterpret_cast<float2*>(a.o_partial + slot * kHead + col) = make_float2(o0 * inv, o1 * inv);
      if (col == 0) a.lse_partial[slot] = sum > 0.f ? (m_max + log2f(sum)) * kLn2 : -INFINITY;
    }
  }
}

template <typename T, typename CacheT, int HEAD_SIZE>
__global__ void __launch_bounds__(kAttnWarps* kWarpSize)
    paged_attention_kernel(const __grid_constant__ AttnArgs a) {
  using Tr = AttnTile<T, CacheT, HEAD_SIZE>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_smem = reinterpret_cast<T*>(smem);                 // [kBlockM][kRowStride]
  T* k_smem = q_smem + Tr::kQElems;                        // [kTTiles][kBlockN][kRowStride]
  T* v_smem = k_smem + Tr::kTTiles * Tr::kKvTileElems;     // [kTTiles][kBlockN][kRowStride]
  uint8_t* raw = reinterpret_cast<uint8_t*>(v_smem + Tr::kTTiles * Tr::kKvTileElems);
  // fp8 only: raw K stages then raw V stages, each [kBlockN][HEAD_SIZE] bytes.

  WorkTile w;
  if (!locate_work_tile<Tr::kBlockN>(a, w)) return;
  auto k_dst = [&](int stage) -> void* {
    return Tr::kFp8 ? static_cast<void*>(raw + stage * Tr::kRawTileBytes)
                    : static_cast<void*>(k_smem + stage * Tr::kKvTileElems);
  };
  auto v_dst = [&](int stage) -> void* {
    return Tr::kFp8 ? static_cast<void*>(raw + (Tr::kStages + stage) * Tr::kRawTileBytes)
                    : static_cast<void*>(v_smem + stage * Tr::kKvTileElems);
  };

  load_q_tile<Tr>(a, w, q_smem);
  if (w.tile_begin < w.tile_end) load_kv_tile<Tr, CacheT>(a, w, w.tile_begin, k_dst(0), v_dst(0));
  attn::cp_async_commit();

  const int warp = threadIdx.x / kWarpSize;
  constexpr int kDecodeKeys = decode_warp_keys<Tr>();
  // CTA-uniform: every row of this CTA fits the first warp's m16 tile.
  const bool decode = kDecodeKeys > 0 && w.num_rows - w.row0 <= 16;
  const bool warp_active = decode || w.row0 + warp * 16 < w.num_rows;  // warp-uniform
  const int row_block = decode ? 0 : warp;
  const RowBounds rb = row_bounds<Tr>(a, w, row_block);
  const ScoreMap sm = make_score_map<Tr>(a.p);
  float o[Tr::kOTiles][4] = {};
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};

  for (int tile = w.tile_begin; tile < w.tile_end; ++tile) {
    const int stage = (tile - w.tile_begin) % Tr::kStages;
    if (tile + 1 < w.tile_end) {
      load_kv_tile<Tr, CacheT>(a, w, tile + 1, k_dst(stage ^ 1), v_dst(stage ^ 1));
    }
    attn::cp_async_commit();  // possibly empty: keeps the group count uniform
    attn::cp_async_wait<1>();  // everything but the prefetch just issued has landed
    __syncthreads();
    const int t_stage = Tr::kFp8 ? 0 : stage;
    if constexpr (Tr::kFp8) {
      unpack_fp8_tile<Tr>(raw + stage * Tr::kRawTileBytes, k_smem);
      unpack_fp8_tile<Tr>(raw + (Tr::kStages + stage) * Tr::kRawTileBytes, v_smem);
      __syncthreads();
    }
    const T* k_tile = k_smem + t_stage * Tr::kKvTileElems;
    const T* v_tile = v_smem + t_stage * Tr::kKvTileElems;
    if constexpr (kDecodeKeys > 0) {
      if (decode) {  // this warp's quarter of the tile's keys, against the CTA's 16 rows
        const int k0 = w.kv_lo + tile * Tr::kBlockN + warp * kDecodeKeys;
        const bool need_mask = k0 + kDecodeKeys > w.min_row_hi || k0 < w.max_row_lo;
        float s[kDecodeKeys / 8][4];
        const int key_row = warp * kDecodeKeys * Tr::kRowStride;
        compute_scores<Tr, kDecodeKeys>(q_smem, k_tile + key_row, s);
        online_softmax<Tr, kDecodeKeys>(s, o, m, l, rb, k0, need_mask, sm);
        accumulate_pv<Tr, kDecodeKeys>(s, v_tile + key_row, o);
      }
    }
    if (!decode && warp_active) {
      const int k0 = w.kv_lo + tile * Tr::kBlockN;
      const bool need_mask = k0 + Tr::kBlockN > w.min_row_hi || k0 < w.max_row_lo;
      float s[Tr::kSTiles][4];
      compute_scores<Tr, Tr::kBlockN>(q_smem + warp * 16 * Tr::kRowStride, k_tile, s);
      online_softmax<Tr, Tr::kBlockN>(s, o, m, l, rb, k0, need_mask, sm);
      accumulate_pv<Tr, Tr::kBlockN>(s, v_tile, o);
    }
    __syncthreads();  // the stage read here is refilled by the next iteration's prefetch
  }
  attn::cp_async_wait<0>();
  if constexpr (kDecodeKeys > 0) {
    if (decode) {
      // The KV stages are free: every prefetch has landed and the loop ended with a barrier
      // (a CTA with no tiles never touched them).
      static_assert(sizeof(float) * kAttnWarps * 16 * (HEAD_SIZE + 2) <=
                        Tr::kSmemBytes - sizeof(T) * Tr::kQElems,
                    "the decode merge fits in the KV stages");
      __syncthreads();
      decode_store_rows<Tr, T>(a, w, o, m, l, sm.v_scale, reinterpret_cast<float*>(k_smem));
      return;
    }
  }
  store_rows<Tr, T>(a, w, o, m, l, sm.v_scale);
}

// CTAs along grid.x: an upper bound of the tiles over all sequences (see the header comment).
inline int64_t attn_grid_tiles(const PagedAttentionParams& p) {
  const int64_t group_size = p.num_heads / p.num_kv_heads;
  return p.num_tokens * group_size / kAttnBlockM + p.num_seqs;
}

}  // namespace pyorch::kernels
