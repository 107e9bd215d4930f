// CPU paged attention (NHD cache) and merge_attn_states.
//
// paged_attention: a work item is (sequence, kv head, up to kRowTile query rows), where the rows
// of a kv head are the flattened (token, head of its GQA group) pairs, so each KV tile is read and
// converted to fp32 once for every query head of the group. Items run on at::parallel_for workers
// that pull from a shared counter, costliest first (causal prefill tiles differ a lot in cost).
// Per item: KV tiles of kKvTile keys are gathered through the block table into fp32 (keys
// transposed, so q.k over a tile is a broadcast-FMA loop over 8-wide vectors), then online softmax
// in fp32 with a vectorized exp, and P.V accumulated in registers 64 dims at a time.
// Any head size up to kMaxHeadSize runs: the loops are compiled for a tile of D dims (a
// capacity, run_head_size), and a head of fewer dims has zeros in the rest, which add nothing to
// q.k and are never stored.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <c10/util/Float8_e4m3fn.h>

#include "common.h"
#include "cpu/cpu_utils.h"
#include "ops.h"

namespace pyorch::cpu {
namespace {

constexpr int kRowTile = 32;  // query rows per work item
constexpr int kKvTile = 64;   // keys per KV tile
// Below this total work (query rows x keys, summed over the work items) one thread runs it all.
constexpr int64_t kMinParallelCost = 4096;
// Head dims a work item's tiles are compiled for (multiples of 8: whole vectors), smallest first:
// vLLM's head sizes run unpadded, any other size on the next capacity up.
constexpr int kHeadCapacities[] = {32, 64, 80, 96, 112, 120, 128, 192, 256, 512, 1024};
constexpr int kMaxHeadSize = 1024;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Eight floats: a GCC/Clang vector, one AVX2 register (two SSE registers without AVX2).
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
static_assert(kKvTile % 8 == 0, "whole vectors per key tile");

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// e^x for x <= 0 (scores minus their running max); exactly 0 below -87, so -inf gives 0.
// Cephes' expf reduction and polynomial (relative error ~1e-7), without libm calls.
inline v8f exp_nonpositive(v8f x) {
  const v8i underflow = x < splat(-87.f);
  x = underflow ? splat(-87.f) : x;
  const v8f round_magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const v8f n = (x * splat(1.44269504088896341f) + round_magic) - round_magic;
  const v8f r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  v8f p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.f);
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;  // 2^n, n in [-126, 0]
  v8f pow2n;
  std::memcpy(&pow2n, &bits, sizeof(pow2n));
  return underflow ? splat(0.f) : p * pow2n;
}

// fp8 e4m3 byte -> float, by table (the scale is folded into q and the output).
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) {
      t[i] = static_cast<float>(
          c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    }
    return t;
  }();
  return table;
}

template <typename CacheT>
inline void cache_row_to_float(const CacheT* src, float* dst, int n, const float* fp8) {
  if constexpr (std::is_same_v<CacheT, uint8_t>) {
    for (int i = 0; i < n; ++i) dst[i] = fp8[src[i]];
  } else {
    for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

struct SeqInfo {
  int64_t q_start;
  int q_len;
  int seq_len;
};

struct WorkItem {
  int seq;
  int kv_head;
  int row0;  // first flattened (token, group head) row of the item
  int64_t cost;
};

// Everything the workers read; raw pointers and element strides, like the CUDA params.
template <typename T, typename CacheT>
struct Problem {
  T* out;
  const T* query;
  const CacheT* k_cache;
  const CacheT* v_cache;
  const int32_t* block_table;
  int64_t q_token_stride, q_head_stride, out_token_stride, out_head_stride;
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int64_t v_block_stride, v_token_stride, v_head_stride;
  int64_t block_table_stride;
  int group_size;
  int block_size;
  bool causal;
  int sliding_window;
  float q_scale;  // softmax scale * k_scale, folded into q
  float v_scale;
  float soft_cap;  // <= 0: off
  const float* fp8;
  int head_size;  // <= the tile's D; dims [head_size, D) of q, k and v are zeros
  std::vector<SeqInfo> seqs;
  float* lse = nullptr;  // optional [num_heads, lse_head_stride]: each row's log-sum-exp
  int64_t lse_head_stride = 0;

  // Key and value rows of KV head kv_head at position pos of the sequence whose block table
  // row is blocks.
  const CacheT* k_row(const int32_t* blocks, int pos, int kv_head) const {
    return k_cache + blocks[pos / block_size] * k_block_stride +
           (pos % block_size) * k_token_stride + kv_head * k_head_stride;
  }
  const CacheT* v_row(const int32_t* blocks, int pos, int kv_head) const {
    return v_cache + blocks[pos / block_size] * v_block_stride +
           (pos % block_size) * v_token_stride + kv_head * v_head_stride;
  }
};

// Visible keys [lo, hi) of the query at `pos`.
struct KeyRange {
  int lo, hi;
};
inline KeyRange key_range(int pos, int seq_len, bool causal, int window) {
  return {window > 0 ? std::max(0, pos - window + 1) : 0,
          causal ? std::min(pos + 1, seq_len) : seq_len};
}

template <int D>
struct alignas(64) Scratch {
  static_assert(D % 8 == 0, "whole vectors per head row");
  float q[kRowTile * D];
  float acc[kRowTile * D];
  float kt[D * kKvTile];  // keys of the tile, transposed: [D][kKvTile]
  float v[kKvTile * D];   // values of the tile: [kKvTile][D]
  float s[kKvTile];
  float row[D];
  float m[kRowTile];
  float l[kRowTile];
  KeyRange range[kRowTile];
};

// s[j] = q . k_j for the kKvTile keys of the tile (8 vector accumulators in registers).
template <int D>
inline void scores_row(const float* q, const float* kt, float* s) {
  constexpr int kVecs = kKvTile / 8;
  v8f acc[kVecs] = {};
  for (int d = 0; d < D; ++d) {
    const v8f qd = splat(q[d]);
    const float* k = kt + d * kKvTile;
    for (int w = 0; w < kVecs; ++w) acc[w] += qd * load8(k + 8 * w);
  }
  for (int w = 0; w < kVecs; ++w) store8(s + 8 * w, acc[w]);
}

// acc[DC, DC + 8W) += sum_j p[j] v[j][DC, DC + 8W), accumulators in registers across keys.
template <int D, int DC, int W>
inline void pv_chunk(float* acc, const float* p, const float* v, int n) {
  v8f a[W];
  for (int w = 0; w < W; ++w) a[w] = load8(acc + DC + 8 * w);
  for (int j = 0; j < n; ++j) {
    const v8f pj = splat(p[j]);
    const float* vj = v + j * D + DC;
    for (int w = 0; w < W; ++w) a[w] += pj * load8(vj + 8 * w);
  }
  for (int w = 0; w < W; ++w) store8(acc + DC + 8 * w, a[w]);
}

template <int D, int DC = 0>
inline void pv_row(float* acc, const float* p, const float* v, int n) {
  if constexpr (DC < D) {
    constexpr int W = std::min(8, (D - DC) / 8);
    pv_chunk<D, DC, W>(acc, p, v, n);
    pv_row<D, DC + 8 * W>(acc, p, v, n);
  }
}

// Gathers keys [k0, k0 + n) of one kv head through the block table into sc.kt / sc.v (fp32);
// dims past the head size are zeros.
template <typename T, typename CacheT, int D>
void load_kv_tile(const Problem<T, CacheT>& pb, const WorkItem& it, int k0, int n, Scratch<D>& sc) {
  const int32_t* blocks = pb.block_table + it.seq * pb.block_table_stride;
  const int hd = pb.head_size;
  for (int j = 0; j < kKvTile; ++j) {
    if (j >= n) {  // the tail of a partial tile: zeros (its scores are masked anyway)
      for (int d = 0; d < D; ++d) sc.kt[d * kKvTile + j] = 0.f;
      continue;
    }
    const CacheT* k = pb.k_row(blocks, k0 + j, it.kv_head);
    const CacheT* v = pb.v_row(blocks, k0 + j, it.kv_head);
    cache_row_to_float(k, sc.row, hd, pb.fp8);
    std::fill(sc.row + hd, sc.row + D, 0.f);
    for (int d = 0; d < D; ++d) sc.kt[d * kKvTile + j] = sc.row[d];
    cache_row_to_float(v, sc.v + j * D, hd, pb.fp8);
    std::fill(sc.v + j * D + hd, sc.v + (j + 1) * D, 0.f);
  }
}

// One row's online-softmax step over the tile in sc.s (raw q.k): cap, mask, rescale, P.V.
template <int D>
void softmax_row_step(float soft_cap, int k0, int n, int r, Scratch<D>& sc) {
  float* s = sc.s;
  const KeyRange kr = sc.range[r];
  float row_max = kNegInf;
  for (int j = 0; j < kKvTile; ++j) {
    float x = s[j];
    if (soft_cap > 0.f) x = soft_cap * std::tanh(x / soft_cap);
    const int key = k0 + j;
    if (j >= n || key < kr.lo || key >= kr.hi) x = kNegInf;
    s[j] = x;
    row_max = std::max(row_max, x);
  }
  if (row_max == kNegInf) return;  // nothing visible to this row in this tile
  const float m_new = std::max(sc.m[r], row_max);
  const float alpha = std::exp(sc.m[r] - m_new);  // 0 while m was -inf
  v8f sum = splat(0.f);
  for (int j = 0; j < kKvTile; j += 8) {
    const v8f p = exp_nonpositive(load8(s + j) - splat(m_new));
    store8(s + j, p);
    sum += p;
  }
  float total = 0.f;
  for (int w = 0; w < 8; ++w) total += sum[w];
  sc.l[r] = sc.l[r] * alpha + total;
  sc.m[r] = m_new;
  float* acc = sc.acc + r * D;
  if (alpha != 1.f) {
    for (int d = 0; d < D; ++d) acc[d] *= alpha;
  }
  pv_row<D>(acc, s, sc.v, n);
}

template <typename T, typename CacheT, int D>
void attend_item(const Problem<T, CacheT>& pb, const WorkItem& it, Scratch<D>& sc) {
  const SeqInfo& si = pb.seqs[it.seq];
  const int G = pb.group_size;
  const int rows = std::min(kRowTile, si.q_len * G - it.row0);
  const int first_pos = si.seq_len - si.q_len;
  int kv_lo = si.seq_len, kv_hi = 0;
  for (int r = 0; r < rows; ++r) {
    const int row = it.row0 + r;
    const int64_t token = si.q_start + row / G;
    const int64_t head = static_cast<int64_t>(it.kv_head) * G + row % G;
    sc.range[r] = key_range(first_pos + row / G, si.seq_len, pb.causal, pb.sliding_window);
    kv_lo = std::min(kv_lo, sc.range[r].lo);
    kv_hi = std::max(kv_hi, sc.range[r].hi);
    const T* q = pb.query + token * pb.q_token_stride + head * pb.q_head_stride;
    for (int d = 0; d < pb.head_size; ++d) sc.q[r * D + d] = static_cast<float>(q[d]) * pb.q_scale;
    std::fill(sc.q + r * D + pb.head_size, sc.q + (r + 1) * D, 0.f);
    std::fill_n(sc.acc + r * D, D, 0.f);
    sc.m[r] = kNegInf;
    sc.l[r] = 0.f;
  }
  for (int k0 = kv_lo; k0 < kv_hi; k0 += kKvTile) {
    const int n = std::min(kKvTile, kv_hi - k0);
    load_kv_tile<T, CacheT, D>(pb, it, k0, n, sc);
    for (int r = 0; r < rows; ++r) {
      if (sc.range[r].hi <= k0 || sc.range[r].lo >= k0 + n) continue;  // tile invisible to r
      scores_row<D>(sc.q + r * D, sc.kt, sc.s);
      softmax_row_step<D>(pb.soft_cap, k0, n, r, sc);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int row = it.row0 + r;
    const int64_t token = si.q_start + row / G;
    const int64_t head = static_cast<int64_t>(it.kv_head) * G + row % G;
    const float inv = sc.l[r] > 0.f ? pb.v_scale / sc.l[r] : 0.f;
    T* o = pb.out + token * pb.out_token_stride + head * pb.out_head_stride;
    for (int d = 0; d < pb.head_size; ++d) o[d] = static_cast<T>(sc.acc[r * D + d] * inv);
    if (pb.lse != nullptr) {
      pb.lse[head * pb.lse_head_stride + token] =
          sc.l[r] > 0.f ? sc.m[r] + std::log(sc.l[r]) : kNegInf;
    }
  }
}

// A cache row of one kv head as fp32 [D]: the cache itself when it is fp32 and exactly D wide,
// else converted into `buf` with zeros past the head size.
template <typename CacheT, int D>
inline const float* cache_row(const CacheT* src, int head_size, float* buf, const float* fp8) {
  if constexpr (std::is_same_v<CacheT, float>) {
    if (head_size == D) return src;
  }
  cache_row_to_float(src, buf, head_size, fp8);
  std::fill(buf + head_size, buf + D, 0.f);
  return buf;
}

// A decode item (one query token; its rows are heads of one kv head's group): scores straight
// from the cache rows for every visible key, one softmax per row, then P.V, without the
// transposed tiles (for a single token the tile copies cost more than the products).
template <typename T, typename CacheT, int D>
void attend_decode_item(const Problem<T, CacheT>& pb, const WorkItem& it, Scratch<D>& sc,
                        std::vector<float>& scores) {
  const SeqInfo& si = pb.seqs[it.seq];
  const int G = pb.group_size;
  const int rows = std::min(kRowTile, G - it.row0);
  const int64_t token = si.q_start;
  const KeyRange kr = key_range(si.seq_len - 1, si.seq_len, pb.causal, pb.sliding_window);
  const int nk = std::max(0, kr.hi - kr.lo);
  const int32_t* blocks = pb.block_table + it.seq * pb.block_table_stride;
  for (int r = 0; r < rows; ++r) {
    const int64_t head = static_cast<int64_t>(it.kv_head) * G + it.row0 + r;
    const T* q = pb.query + token * pb.q_token_stride + head * pb.q_head_stride;
    for (int d = 0; d < pb.head_size; ++d) sc.q[r * D + d] = static_cast<float>(q[d]) * pb.q_scale;
    std::fill(sc.q + r * D + pb.head_size, sc.q + (r + 1) * D, 0.f);
    std::fill_n(sc.acc + r * D, D, 0.f);
  }
  scores.resize(static_cast<size_t>(rows) * nk);
  for (int j = 0; j < nk; ++j) {
    const float* k =
        cache_row<CacheT, D>(pb.k_row(blocks, kr.lo + j, it.kv_head), pb.head_size, sc.row, pb.fp8);
    for (int r = 0; r < rows; ++r) {
      v8f acc = splat(0.f);
      for (int d = 0; d < D; d += 8) acc += load8(sc.q + r * D + d) * load8(k + d);
      float x = 0.f;
      for (int w = 0; w < 8; ++w) x += acc[w];
      if (pb.soft_cap > 0.f) x = pb.soft_cap * std::tanh(x / pb.soft_cap);
      scores[static_cast<size_t>(r) * nk + j] = x;
    }
  }
  for (int r = 0; r < rows; ++r) {
    float* s = scores.data() + static_cast<size_t>(r) * nk;
    float m = kNegInf;
    for (int j = 0; j < nk; ++j) m = std::max(m, s[j]);
    float l = 0.f;
    int j = 0;
    if (nk > 0) {
      v8f sum = splat(0.f);
      for (; j + 8 <= nk; j += 8) {
        const v8f p = exp_nonpositive(load8(s + j) - splat(m));
        store8(s + j, p);
        sum += p;
      }
      for (int w = 0; w < 8; ++w) l += sum[w];
      for (; j < nk; ++j) {
        s[j] = std::exp(s[j] - m);
        l += s[j];
      }
    }
    sc.m[r] = m;
    sc.l[r] = l;
  }
  for (int j = 0; j < nk; ++j) {
    const float* v =
        cache_row<CacheT, D>(pb.v_row(blocks, kr.lo + j, it.kv_head), pb.head_size, sc.row, pb.fp8);
    for (int r = 0; r < rows; ++r) {
      const v8f p = splat(scores[static_cast<size_t>(r) * nk + j]);
      float* acc = sc.acc + r * D;
      for (int d = 0; d < D; d += 8) store8(acc + d, load8(acc + d) + p * load8(v + d));
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t head = static_cast<int64_t>(it.kv_head) * G + it.row0 + r;
    const float inv = sc.l[r] > 0.f ? pb.v_scale / sc.l[r] : 0.f;
    T* o = pb.out + token * pb.out_token_stride + head * pb.out_head_stride;
    for (int d = 0; d < pb.head_size; ++d) o[d] = static_cast<T>(sc.acc[r * D + d] * inv);
    if (pb.lse != nullptr) {
      pb.lse[head * pb.lse_head_stride + token] =
          sc.l[r] > 0.f ? sc.m[r] + std::log(sc.l[r]) : kNegInf;
    }
  }
}

template <typename T, typename CacheT, int D>
void run_items(const Problem<T, CacheT>& pb, const std::vector<WorkItem>& items) {
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  // Small batches (a decode step of a few sequences) run on the calling thread: a thread-pool
  // wake and join costs more than their work, far more on a loaded machine.
  int64_t total_cost = 0;
  for (const WorkItem& it : items) total_cost += it.cost;
  const int64_t num_workers =
      total_cost < kMinParallelCost ? 1 : std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    // Not value-initialized: every field an item reads, it writes first.
    std::unique_ptr<Scratch<D>> scratch(new Scratch<D>);
    std::vector<float> scores;
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      if (pb.seqs[items[i].seq].q_len == 1) {
        attend_decode_item<T, CacheT, D>(pb, items[i], *scratch, scores);
      } else {
        attend_item<T, CacheT, D>(pb, items[i], *scratch);
      }
    }
  });
}

// The smallest capacity that holds head_size (0: none, past kMaxHeadSize).
constexpr int head_capacity(int64_t head_size) {
  for (int d : kHeadCapacities) {
    if (head_size <= d) return d;
  }
  return 0;
}
static_assert(head_capacity(kMaxHeadSize) == kMaxHeadSize, "the largest capacity");

template <typename T, typename CacheT>
void run_head_size(const Problem<T, CacheT>& pb, const std::vector<WorkItem>& items) {
  switch (head_capacity(pb.head_size)) {
#define PYORCH_CPU_CASE(D) \
  case D: return run_items<T, CacheT, D>(pb, items);
    PYORCH_CPU_CASE(32)
    PYORCH_CPU_CASE(64)
    PYORCH_CPU_CASE(80)
    PYORCH_CPU_CASE(96)
    PYORCH_CPU_CASE(112)
    PYORCH_CPU_CASE(120)
    PYORCH_CPU_CASE(128)
    PYORCH_CPU_CASE(192)
    PYORCH_CPU_CASE(256)
    PYORCH_CPU_CASE(512)
    PYORCH_CPU_CASE(1024)
#undef PYORCH_CPU_CASE
    default: TORCH_CHECK(false, "Unsupported head size: " + std::to_string(pb.head_size));
  }
}

// Reads and validates the host-side batch description; the CPU op can afford to check every
// value it will index with.
std::vector<SeqInfo> read_seqs(const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                               const at::Tensor& block_table, int64_t num_tokens,
                               int64_t num_blocks, int64_t block_size, int sliding_window) {
  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1);
  std::vector<SeqInfo> seqs(num_seqs);
  TORCH_CHECK(num_seqs == 0 || qsl[0] >= 0, "paged_attention: query_start_loc[0] < 0");
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int q_len = qsl[i + 1] - qsl[i];
    const int seq_len = lens[i];
    TORCH_CHECK(q_len >= 0 && qsl[i + 1] <= num_tokens,
                "paged_attention: query_start_loc must "
                "be non-decreasing and at most num_tokens");
    TORCH_CHECK(q_len <= seq_len && seq_len <= max_blocks * block_size,
                "paged_attention: "
                "sequence ",
                i, " has q_len ", q_len, " and seq_len ", seq_len,
                " (needs q_len <= seq_len <= max_blocks_per_seq * block_size)");
    seqs[i] = {qsl[i], q_len, seq_len};
    if (q_len == 0) continue;
    const int first_key =
        sliding_window > 0 ? std::max(0, seq_len - q_len - sliding_window + 1) : 0;
    for (int64_t b = first_key / block_size; b * block_size < seq_len; ++b) {
      const int32_t block = table[i * block_table.stride(0) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_attention: block_table[", i, "][", b,
                  "] = ", block, " is outside the cache's ", num_blocks, " blocks");
    }
  }
  return seqs;
}

template <typename T, typename CacheT>
std::vector<WorkItem> make_items(const Problem<T, CacheT>& pb, int64_t num_kv_heads) {
  std::vector<WorkItem> items;
  const int G = pb.group_size;
  for (int s = 0; s < static_cast<int>(pb.seqs.size()); ++s) {
    const SeqInfo& si = pb.seqs[s];
    const int first_pos = si.seq_len - si.q_len;
    for (int row0 = 0; row0 < si.q_len * G; row0 += kRowTile) {
      const int row1 = std::min(row0 + kRowTile, si.q_len * G) - 1;
      const KeyRange first =
          key_range(first_pos + row0 / G, si.seq_len, pb.causal, pb.sliding_window);
      const KeyRange last =
          key_range(first_pos + row1 / G, si.seq_len, pb.causal, pb.sliding_window);
      const int64_t cost = int64_t{row1 - row0 + 1} * (last.hi - first.lo + kKvTile);
      for (int h = 0; h < num_kv_heads; ++h) items.push_back({s, h, row0, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

void check_cpu_cache(const at::Tensor& cache, const at::Tensor& query, const char* name) {
  TORCH_CHECK(cache.device().is_cpu() && cache.dim() == 4 && cache.stride(3) == 1,
              "paged_attention: ", name,
              " must be a CPU [num_blocks, block_size, num_kv_heads, "
              "head_size] tensor with a contiguous last dimension");
  TORCH_CHECK(cache.size(3) == query.size(2), "paged_attention: ", name, " head_size ",
              cache.size(3), " != query head_size ", query.size(2));
}

void check_cpu_int32_vector(const at::Tensor& t, const char* name) {
  TORCH_CHECK(
      t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(),
      "paged_attention: ", name, " must be a contiguous 1-D int32 CPU tensor");
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, const at::Tensor& block_table,
                     int64_t max_query_len, int64_t max_seq_len, double scale, bool causal,
                     int64_t sliding_window, double logits_soft_cap,
                     const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                     const at::Tensor& v_scale, const std::optional<at::Tensor>& lse) {
  (void)max_query_len;  // grid-sizing hints for the CUDA kernel; the CPU reads the real lengths
  (void)max_seq_len;
  const auto dtype = query.scalar_type();
  TORCH_CHECK(query.device().is_cpu() && out.device().is_cpu(),
              "paged_attention: tensors must be on CPU");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "paged_attention: query must be float32, bfloat16 or float16 on CPU, got ", dtype);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1,
              "paged_attention: query must be "
              "[num_tokens, num_heads, head_size] with a contiguous last dimension");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == dtype && out.stride(2) == 1,
              "paged_attention: out must match query's shape and dtype");
  const int64_t head_size = query.size(2);
  TORCH_CHECK(head_size >= 1 && head_size <= kMaxHeadSize,
              // std::to_string: formatting an integer through c10::str segfaulted in the
              // GPU machine's build (ostream<<long inside _C.so); see the attention report.
              "Unsupported head size: " + std::to_string(head_size) +
                  " (the CPU kernel takes 1 to " + std::to_string(kMaxHeadSize) + ")");
  const auto kv_dtype = parse_kv_cache_dtype(kv_cache_dtype);
  check_cpu_cache(key_cache, query, "key_cache");
  check_cpu_cache(value_cache, query, "value_cache");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(),
              "paged_attention: key_cache and "
              "value_cache shapes differ");
  check_kv_cache_dtype(key_cache, kv_dtype, dtype, "paged_attention");
  check_kv_cache_dtype(value_cache, kv_dtype, dtype, "paged_attention");
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_kv_heads > 0 && query.size(1) % num_kv_heads == 0, "paged_attention: num_heads ",
              query.size(1), " is not a multiple of num_kv_heads ", num_kv_heads);
  check_cpu_int32_vector(query_start_loc, "query_start_loc");
  check_cpu_int32_vector(seq_lens, "seq_lens");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1,
              "paged_attention: query_start_loc must hold num_seqs + 1 entries");
  TORCH_CHECK(block_table.device().is_cpu() && block_table.scalar_type() == at::kInt &&
                  block_table.dim() == 2 && block_table.size(0) >= seq_lens.size(0) &&
                  block_table.stride(1) == 1,
              "paged_attention: block_table must be an int32 CPU [num_seqs, max_blocks] tensor");
  const bool fp8 = kv_dtype == KVCacheDType::kFp8E4M3;
  const float k_scale_v = fp8 ? scale_value(k_scale, "paged_attention") : 1.f;
  const float v_scale_v = fp8 ? scale_value(v_scale, "paged_attention") : 1.f;
  const int window = static_cast<int>(std::max<int64_t>(sliding_window, 0));
  if (lse.has_value()) check_lse_out(*lse, query, "CPU");
  std::vector<SeqInfo> seqs = read_seqs(query_start_loc, seq_lens, block_table, query.size(0),
                                        key_cache.size(0), key_cache.size(1), window);

  PYORCH_CPU_DISPATCH_FLOATS(dtype, "paged_attention", [&] {
    auto run = [&](auto cache_tag) {
      using CacheT = decltype(cache_tag);
      Problem<scalar_t, CacheT> pb{out.data_ptr<scalar_t>(),
                                   query.const_data_ptr<scalar_t>(),
                                   static_cast<const CacheT*>(key_cache.const_data_ptr()),
                                   static_cast<const CacheT*>(value_cache.const_data_ptr()),
                                   block_table.const_data_ptr<int32_t>(),
                                   query.stride(0),
                                   query.stride(1),
                                   out.stride(0),
                                   out.stride(1),
                                   key_cache.stride(0),
                                   key_cache.stride(1),
                                   key_cache.stride(2),
                                   value_cache.stride(0),
                                   value_cache.stride(1),
                                   value_cache.stride(2),
                                   block_table.stride(0),
                                   static_cast<int>(query.size(1) / num_kv_heads),
                                   static_cast<int>(key_cache.size(1)),
                                   causal,
                                   window,
                                   static_cast<float>(scale) * k_scale_v,
                                   v_scale_v,
                                   static_cast<float>(logits_soft_cap),
                                   fp8 ? fp8_table().data() : nullptr,
                                   static_cast<int>(head_size),
                                   std::move(seqs)};
      if (lse.has_value()) {
        pb.lse = lse->data_ptr<float>();
        pb.lse_head_stride = lse->stride(0);
      }
      run_head_size(pb, make_items(pb, num_kv_heads));
    };
    if (fp8) {
      run(uint8_t{});
    } else {
      run(scalar_t{});
    }
  });
}

void merge_attn_states(at::Tensor& output, std::optional<at::Tensor> output_lse,
                       const at::Tensor& prefix_output, const at::Tensor& prefix_lse,
                       const at::Tensor& suffix_output, const at::Tensor& suffix_lse) {
  const auto dtype = output.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "merge_attn_states: outputs must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(output.dim() == 3 && output.stride(2) == 1,
              "merge_attn_states: output must be "
              "[num_tokens, num_heads, head_size] with a contiguous last dimension");
  for (const at::Tensor* t : {&prefix_output, &suffix_output}) {
    TORCH_CHECK(t->device().is_cpu() && t->sizes() == output.sizes() && t->scalar_type() == dtype &&
                    t->stride(2) == 1,
                "merge_attn_states: prefix/suffix outputs must match output's shape and dtype");
  }
  const int64_t num_tokens = output.size(0);
  const int64_t num_heads = output.size(1);
  const int64_t head_size = output.size(2);
  std::vector<const at::Tensor*> lses = {&prefix_lse, &suffix_lse};
  if (output_lse.has_value()) lses.push_back(&*output_lse);
  for (const at::Tensor* t : lses) {
    TORCH_CHECK(
        t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 &&
            t->size(0) == num_heads && t->size(1) == num_tokens && t->is_contiguous(),
        "merge_attn_states: lse tensors must be contiguous float32 [num_heads, num_tokens]");
  }
  const float* p_lse = prefix_lse.const_data_ptr<float>();
  const float* s_lse = suffix_lse.const_data_ptr<float>();
  float* o_lse = output_lse.has_value() ? output_lse->data_ptr<float>() : nullptr;
  PYORCH_CPU_DISPATCH_FLOATS(dtype, "merge_attn_states", [&] {
    scalar_t* out = output.data_ptr<scalar_t>();
    const scalar_t* p_out = prefix_output.const_data_ptr<scalar_t>();
    const scalar_t* s_out = suffix_output.const_data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens * num_heads, 16, [&](int64_t begin, int64_t end) {
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t t = pair / num_heads, h = pair % num_heads;
        // +inf (FlashAttention-2's empty part) reads as -inf; see cuda/include/pyorch/attention.h.
        const float lp =
            std::isinf(p_lse[h * num_tokens + t]) ? kNegInf : p_lse[h * num_tokens + t];
        const float ls =
            std::isinf(s_lse[h * num_tokens + t]) ? kNegInf : s_lse[h * num_tokens + t];
        const float m = std::max(lp, ls);
        scalar_t* o = out + t * output.stride(0) + h * output.stride(1);
        const scalar_t* po = p_out + t * prefix_output.stride(0) + h * prefix_output.stride(1);
        const scalar_t* so = s_out + t * suffix_output.stride(0) + h * suffix_output.stride(1);
        if (m == kNegInf) {  // both parts empty
          std::fill_n(o, head_size, static_cast<scalar_t>(0.f));
          if (o_lse) o_lse[h * num_tokens + t] = kNegInf;
          continue;
        }
        const float pe = std::exp(lp - m), se = std::exp(ls - m);
        const float sum = pe + se;
        const float pw = pe / sum, sw = se / sum;
        for (int64_t d = 0; d < head_size; ++d) {
          float acc = 0.f;  // an empty part may hold garbage: skip it instead of multiplying by 0
          if (pe > 0.f) acc += static_cast<float>(po[d]) * pw;
          if (se > 0.f) acc += static_cast<float>(so[d]) * sw;
          o[d] = static_cast<scalar_t>(acc);
        }
        if (o_lse) o_lse[h * num_tokens + t] = std::log(sum) + m;
      }
    });
  });
}

void cascade_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& query_start_loc,
                       const at::Tensor& suffix_seq_lens, const at::Tensor& suffix_block_table,
                       int64_t max_query_len, int64_t suffix_max_seq_len, const at::Tensor& perm,
                       const at::Tensor& prefix_query_start_loc, const at::Tensor& prefix_seq_lens,
                       const at::Tensor& prefix_block_table, int64_t prefix_max_query_len,
                       int64_t prefix_max_seq_len, double scale, double logits_soft_cap,
                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                       const at::Tensor& v_scale) {
  TORCH_CHECK(perm.device().is_cpu() && perm.scalar_type() == at::kLong && perm.dim() == 1 &&
                  perm.is_contiguous(),
              "cascade_attention: perm must be a contiguous 1-D int64 CPU tensor");
  const int64_t num_tokens = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t grouped = perm.size(0);
  const int64_t* rows = perm.const_data_ptr<int64_t>();
  std::vector<bool> seen(static_cast<size_t>(num_tokens), false);
  for (int64_t i = 0; i < grouped; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < num_tokens && !seen[rows[i]], "cascade_attention: perm[",
                i, "] = ", rows[i], " is out of range or repeated");
    seen[rows[i]] = true;
  }
  const auto f32 = query.options().dtype(at::kFloat);
  at::Tensor suffix_lse = at::empty({num_heads, num_tokens}, f32);
  paged_attention(out, query, key_cache, value_cache, query_start_loc, suffix_seq_lens,
                  suffix_block_table, max_query_len, suffix_max_seq_len, scale, /*causal=*/true,
                  /*sliding_window=*/0, logits_soft_cap, kv_cache_dtype, k_scale, v_scale,
                  suffix_lse);
  if (grouped == 0) return;
  at::Tensor grouped_query = at::index_select(query, 0, perm);
  at::Tensor prefix_out = at::empty_like(grouped_query, at::MemoryFormat::Contiguous);
  at::Tensor prefix_lse = at::empty({num_heads, grouped}, f32);
  paged_attention(prefix_out, grouped_query, key_cache, value_cache, prefix_query_start_loc,
                  prefix_seq_lens, prefix_block_table, prefix_max_query_len, prefix_max_seq_len,
                  scale, /*causal=*/false, /*sliding_window=*/0, logits_soft_cap, kv_cache_dtype,
                  k_scale, v_scale, prefix_lse);
  const int64_t head_size = out.size(2);
  const float* p_lse = prefix_lse.const_data_ptr<float>();
  const float* s_lse = suffix_lse.const_data_ptr<float>();
  PYORCH_CPU_DISPATCH_FLOATS(out.scalar_type(), "cascade_attention", [&] {
    scalar_t* o_all = out.data_ptr<scalar_t>();
    const scalar_t* p_all = prefix_out.const_data_ptr<scalar_t>();
    at::parallel_for(0, grouped * num_heads, 16, [&](int64_t begin, int64_t end) {
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t i = pair / num_heads, h = pair % num_heads, row = rows[i];
        const float lp = p_lse[h * grouped + i];
        const float ls = s_lse[h * num_tokens + row];
        const float m = std::max(lp, ls);
        scalar_t* o = o_all + row * out.stride(0) + h * out.stride(1);
        const scalar_t* po = p_all + i * prefix_out.stride(0) + h * prefix_out.stride(1);
        if (m == kNegInf) {
          std::fill_n(o, head_size, static_cast<scalar_t>(0.f));
          continue;
        }
        const float pe = std::exp(lp - m), se = std::exp(ls - m);
        const float pw = pe / (pe + se), sw = se / (pe + se);
        for (int64_t d = 0; d < head_size; ++d) {
          float acc = 0.f;
          if (pe > 0.f) acc += static_cast<float>(po[d]) * pw;
          if (se > 0.f) acc += static_cast<float>(o[d]) * sw;
          o[d] = static_cast<scalar_t>(acc);
        }
      }
    });
  });
}

}  // namespace pyorch::cpu
