// Shared building blocks of the paged attention kernels (NHD cache): the launch arguments
// (AttnArgs), a CTA's work (WorkTile), per-row key bounds, the score map (scale, soft cap, fp8
// scales), fp8 tile unpacking, and the FlashAttention-2 style warp-level pieces (Q K^T on mma.sync,
// online softmax in the log2 domain, P V with the scores reused as the A operand).
//
// Rows. For a kv head, the query rows of sequence i are the pairs (token t, head g of the GQA
// group), flattened as row = t * group_size + g, so one read of a KV tile serves every query head
// of the group. attention.cu sends sequences with at most 16 rows to paged_decode_kernel
// (paged_decode.cuh) and the rest to the prefill kernels (paged_prefill.cuh, mma.sync;
// paged_prefill_sm90.cuh, wgmma), which are built from these pieces. With num_splits > 1 a CTA
// covers a slice of the KV tiles and writes a normalized partial output and its log-sum-exp;
// merge_split_kv_kernel (merge_attn_states.cuh) combines them.
//
// kAttnBlockM / attn_block_n / attn_grid_tiles describe the 64-row x 64-key tiling that the
// split heuristic in attention.cu still uses to estimate how many CTAs a call has.
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

// Head dims of a kernel's tiles: the head size rounded up to whole mma k-steps of 16. A head size
// that is no multiple of 16 (120) runs at the next one: its loads zero-fill dims [head_size, tile)
// of q, k and v, which add nothing to q.k, and the output dims there are never stored.
constexpr int attn_tile_head(int head_size) { return (head_size + 15) / 16 * 16; }

// Kernel arguments: the C API params plus what the launcher derives from them.
struct AttnArgs {
  PagedAttentionParams p;
  int group_size;      // num_heads / num_kv_heads
  int num_splits;      // KV slices per (tile, kv head); 1: write `out` directly
  float* o_partial;    // [num_splits, num_tokens, num_heads, head_size] when num_splits > 1
  float* lse_partial;  // [num_splits, num_tokens, num_heads] when num_splits > 1
  // [num_splits] zeroed before the launch: the persistent sm90 prefill kernel's item counters
  // (null: its CTAs take items in a fixed order instead).
  int* item_counters = nullptr;
};

// What one CTA computes: rows [row0, row0 + kBlockM) of sequence `seq` (clipped to num_rows)
// against KV tiles [tile_begin, tile_end) of the key range [kv_lo, kv_hi) its rows can see.
struct WorkTile {
  int seq;
  int64_t q_start;  // first query row of the sequence in query/out
  int num_rows;     // q_len * group_size
  int row0;
  int first_pos;  // position of the sequence's first query token
  int seq_len;
  int kv_lo, kv_hi;
  int min_row_hi;  // smallest exclusive key bound over the CTA's rows
  int max_row_lo;  // largest inclusive key bound over the CTA's rows
  int tile_begin, tile_end;
  int live_splits;  // decode: splits that hold keys of the sequence (see locate_decode_work)
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

// raw fp8 tile [kBlockN][tile head] -> padded T tile [kBlockN][kRowStride] (scale applied later).
template <class Tr, typename T>
__device__ void unpack_fp8_tile(const uint8_t* raw, T* dst) {
  constexpr int kHeadSize = Tr::kOTiles * 8;  // the tile's head dims: raw rows of as many bytes
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
  // B (K^T, "col"): matrices (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (8-15,
  // 8-15).
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
__device__ __forceinline__ void online_softmax(float (&s)[NKEYS / 8][4], float (&o)[Tr::kOTiles][4],
                                               float (&m)[2], float (&l)[2], const RowBounds& rb,
                                               int k0, bool need_mask, const ScoreMap& sm,
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

// An upper bound of the 64-row tiles over all sequences: sequence i has at most
// ceil(q_len * G / kAttnBlockM) <= q_len * G / kAttnBlockM + 1 of them.
inline int64_t attn_grid_tiles(const PagedAttentionParams& p) {
  const int64_t group_size = p.num_heads / p.num_kv_heads;
  return p.num_tokens * group_size / kAttnBlockM + p.num_seqs;
}

}  // namespace pyorch::kernels
