// CPU paged_attention_v1 / paged_attention_v2 on vLLM's split KV layout: the reference backend.
//
// One task per (sequence, kv head[, partition]): the task attends all query heads of that kv head
// at once, so each KV block is converted to fp32 once per task. Per block, keys are transposed to
// [head_size, block_size] and values to [block_size, head_size], so that the q.k loop runs over
// tokens and the p.V loop over head dims: both are plain fp32 axpy loops the compiler vectorizes.
// v2 computes each 512-token partition into exp_sums / max_logits / tmp_out exactly as the CUDA
// kernel defines them, then combines the partitions.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include "cpu/cpu_utils.h"
#include "ops.h"
#include "paged_attention_v1_v2_checks.h"

namespace pyorch::cpu {
namespace {

constexpr int64_t kPartitionSize = kPagedAttentionV2PartitionSize;

// fp8 e4m3 byte -> float, for all 256 bytes.
const float* fp8_e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      t[b] = static_cast<float>(
          c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    }
    return t;
  }();
  return table.data();
}

// Raw pointers and sizes of one call. CacheT is T, or uint8_t for fp8 caches.
template <typename T, typename CacheT>
struct Problem {
  const T* query;  // [num_seqs, num_heads, head_size]
  int64_t q_seq_stride, q_head_stride;
  const CacheT* key_cache;  // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  int64_t k_block_stride, k_head_stride;
  const CacheT* value_cache;  // [num_blocks, num_kv_heads, head_size, block_size]
  int64_t v_block_stride, v_head_stride;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  int64_t block_table_stride;
  const int32_t* seq_lens;  // [num_seqs]
  const float* alibi;       // [num_heads] or nullptr
  int64_t num_heads, num_kv_heads, head_size, block_size, x;
  float scale, k_scale, v_scale;  // the scales are 1 unless the cache is fp8
  const float* fp8_table;         // fp8 byte -> float, for fp8 caches

  float load(CacheT v) const {
    if constexpr (std::is_same_v<CacheT, uint8_t>) {
      return fp8_table[v];
    } else {
      return static_cast<float>(v);
    }
  }
};

// Per-thread buffers, grown on demand.
struct Workspace {
  std::vector<float> q;       // [group, head_size], pre-scaled
  std::vector<float> scores;  // [group, range length]
  std::vector<float> kt;      // [head_size, block_size]
  std::vector<float> vt;      // [block_size, head_size]
  std::vector<float> s;       // [block_size]
};

// Attends the query heads of kv_head in sequence seq over tokens [begin, end) (end > begin).
// Per head g of the group: acc[g, :] = sum_t e_t * v_t (v_scale applied, not normalized),
// row_max[g] = max score, row_sum[g] = sum_t e_t, with e_t = exp(score_t - row_max[g]).
template <typename T, typename CacheT>
void attend_range(const Problem<T, CacheT>& p, int64_t seq, int64_t kv_head, int64_t begin,
                  int64_t end, Workspace& ws, float* acc, float* row_max, float* row_sum) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t hs = p.head_size, bs = p.block_size, x = p.x;
  const int64_t len = end - begin;
  const int64_t seq_len = p.seq_lens[seq];
  ws.q.resize(group * hs);
  ws.scores.resize(group * len);
  ws.kt.resize(hs * bs);
  ws.vt.resize(bs * hs);
  ws.s.resize(bs);
  for (int64_t g = 0; g < group; ++g) {
    const T* q_row = p.query + seq * p.q_seq_stride + (kv_head * group + g) * p.q_head_stride;
    for (int64_t d = 0; d < hs; ++d) ws.q[g * hs + d] = static_cast<float>(q_row[d]) * p.scale;
  }
  const int32_t* block_table = p.block_tables + seq * p.block_table_stride;
  const int64_t first_block = begin / bs, end_block = (end + bs - 1) / bs;

  // Scores: scale * q.k * k_scale + alibi.
  for (int64_t blk = first_block; blk < end_block; ++blk) {
    const CacheT* kb =
        p.key_cache + block_table[blk] * p.k_block_stride + kv_head * p.k_head_stride;
    for (int64_t c = 0; c < hs / x; ++c) {  // kb: [head_size / x, block_size, x]
      for (int64_t t = 0; t < bs; ++t) {
        for (int64_t j = 0; j < x; ++j)
          ws.kt[(c * x + j) * bs + t] = p.load(kb[(c * bs + t) * x + j]);
      }
    }
    const int64_t t_lo = std::max(begin, blk * bs) - blk * bs;
    const int64_t t_hi = std::min(end, blk * bs + bs) - blk * bs;
    for (int64_t g = 0; g < group; ++g) {
      float* s = ws.s.data();
      std::fill(s, s + bs, 0.f);
      const float* q = ws.q.data() + g * hs;
      for (int64_t d = 0; d < hs; ++d) {
        const float qd = q[d];
        const float* krow = ws.kt.data() + d * bs;
        for (int64_t t = 0; t < bs; ++t) s[t] += qd * krow[t];
      }
      const float slope = p.alibi != nullptr ? p.alibi[kv_head * group + g] : 0.f;
      for (int64_t t = t_lo; t < t_hi; ++t) {
        const int64_t token = blk * bs + t;
        ws.scores[g * len + token - begin] =
            s[t] * p.k_scale + slope * static_cast<float>(token - seq_len + 1);
      }
    }
  }

  // Softmax numerators, per head.
  for (int64_t g = 0; g < group; ++g) {
    float* sc = ws.scores.data() + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < len; ++i) m = std::max(m, sc[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < len; ++i) {
      sc[i] = std::exp(sc[i] - m);
      sum += sc[i];
    }
    row_max[g] = m;
    row_sum[g] = sum;
  }

  // acc += e * v over the valid tokens only: unused cache slots may hold anything.
  std::fill(acc, acc + group * hs, 0.f);
  for (int64_t blk = first_block; blk < end_block; ++blk) {
    const CacheT* vb =
        p.value_cache + block_table[blk] * p.v_block_stride + kv_head * p.v_head_stride;
    const int64_t t_lo = std::max(begin, blk * bs) - blk * bs;
    const int64_t t_hi = std::min(end, blk * bs + bs) - blk * bs;
    for (int64_t d = 0; d < hs; ++d) {  // vb: [head_size, block_size]
      for (int64_t t = t_lo; t < t_hi; ++t) ws.vt[t * hs + d] = p.load(vb[d * bs + t]);
    }
    for (int64_t g = 0; g < group; ++g) {
      float* a = acc + g * hs;
      for (int64_t t = t_lo; t < t_hi; ++t) {
        const float e = ws.scores[g * len + blk * bs + t - begin];
        const float* v = ws.vt.data() + t * hs;
        for (int64_t d = 0; d < hs; ++d) a[d] += e * v[d];
      }
    }
  }
  if (p.v_scale != 1.f) {
    for (int64_t i = 0; i < group * hs; ++i) acc[i] *= p.v_scale;
  }
}

// Rejects block tables and lengths that would read outside the caches (cheap on the host).
void check_block_tables(const PagedAttentionV1V2Shape& s, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, int64_t max_seq_len, const char* op) {
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* bt = block_tables.const_data_ptr<int32_t>();
  const int64_t bt_stride = block_tables.stride(0);
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    TORCH_CHECK(lens[i] >= 0 && lens[i] <= max_seq_len, op, ": seq_lens[", i, "] = ", lens[i],
                " is outside [0, max_seq_len = ", max_seq_len, "]");
    const int64_t num_blocks = (lens[i] + s.block_size - 1) / s.block_size;
    TORCH_CHECK(num_blocks <= s.max_blocks_per_seq, op, ": seq_lens[", i, "] = ", lens[i],
                " needs more blocks than block_tables has columns");
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int32_t id = bt[i * bt_stride + b];
      TORCH_CHECK(id >= 0 && id < s.num_blocks, op, ": block_tables[", i, ", ", b, "] = ", id,
                  " is not a block of the cache");
    }
  }
}

template <typename T, typename CacheT>
Problem<T, CacheT> make_problem(const PagedAttentionV1V2Shape& s, const at::Tensor& query,
                                const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const std::optional<at::Tensor>& alibi_slopes, double scale,
                                const at::Tensor& k_scale, const at::Tensor& v_scale) {
  const bool fp8 = s.kv_dtype == KVCacheDType::kFp8E4M3;
  Problem<T, CacheT> p{};
  p.query = query.const_data_ptr<T>();
  p.q_seq_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  p.key_cache = static_cast<const CacheT*>(key_cache.const_data_ptr());
  p.k_block_stride = key_cache.stride(0);
  p.k_head_stride = key_cache.stride(1);
  p.value_cache = static_cast<const CacheT*>(value_cache.const_data_ptr());
  p.v_block_stride = value_cache.stride(0);
  p.v_head_stride = value_cache.stride(1);
  p.block_tables = block_tables.const_data_ptr<int32_t>();
  p.block_table_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.const_data_ptr<int32_t>();
  p.alibi = alibi_slopes.has_value() ? alibi_slopes->const_data_ptr<float>() : nullptr;
  p.num_heads = s.num_heads;
  p.num_kv_heads = s.num_kv_heads;
  p.head_size = s.head_size;
  p.block_size = s.block_size;
  p.x = s.x;
  p.scale = static_cast<float>(scale);
  p.k_scale = fp8 ? scale_value(k_scale, "paged_attention") : 1.f;
  p.v_scale = fp8 ? scale_value(v_scale, "paged_attention") : 1.f;
  p.fp8_table = fp8 ? fp8_e4m3_table() : nullptr;
  return p;
}

// out[seq, head, :] = values (rounded to T).
template <typename T>
void store_row(const at::Tensor& out, int64_t seq, int64_t head, const float* values, int64_t n) {
  T* o = out.data_ptr<T>() + seq * out.stride(0) + head * out.stride(1);
  from_float(values, o, n);
}

template <typename T, typename CacheT>
void run_v1(const Problem<T, CacheT>& p, int64_t num_seqs, at::Tensor& out) {
  const int64_t group = p.num_heads / p.num_kv_heads, hs = p.head_size;
  at::parallel_for(0, num_seqs * p.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Workspace ws;
    std::vector<float> acc(group * hs), row_max(group), row_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / p.num_kv_heads, kv_head = task % p.num_kv_heads;
      const int64_t seq_len = p.seq_lens[seq];
      if (seq_len == 0) {
        std::fill(acc.begin(), acc.end(), 0.f);  // attending to nothing gives zeros
      } else {
        attend_range(p, seq, kv_head, 0, seq_len, ws, acc.data(), row_max.data(), row_sum.data());
        for (int64_t g = 0; g < group; ++g) {
          const float inv = 1.f / row_sum[g];
          for (int64_t d = 0; d < hs; ++d) acc[g * hs + d] *= inv;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        store_row<T>(out, seq, kv_head * group + g, acc.data() + g * hs, hs);
      }
    }
  });
}

template <typename T, typename CacheT>
void run_v2(const Problem<T, CacheT>& p, int64_t num_seqs, int64_t max_parts, at::Tensor& out,
            at::Tensor& exp_sums, at::Tensor& max_logits, at::Tensor& tmp_out) {
  const int64_t group = p.num_heads / p.num_kv_heads, hs = p.head_size;
  float* es = exp_sums.data_ptr<float>();  // [num_seqs, num_heads, max_parts]
  float* ml = max_logits.data_ptr<float>();
  T* tmp = tmp_out.data_ptr<T>();  // [num_seqs, num_heads, max_parts, head_size]
  auto num_parts = [&](int64_t seq) {
    return (p.seq_lens[seq] + kPartitionSize - 1) / kPartitionSize;
  };

  // Pass 1: every partition of every (sequence, kv head), normalized by its own exp-sum.
  at::parallel_for(0, num_seqs * p.num_kv_heads * max_parts, 1, [&](int64_t begin, int64_t end) {
    Workspace ws;
    std::vector<float> acc(group * hs), row_max(group), row_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t part = task % max_parts;
      const int64_t kv_head = (task / max_parts) % p.num_kv_heads;
      const int64_t seq = task / (max_parts * p.num_kv_heads);
      if (part >= num_parts(seq)) continue;
      const int64_t tok_begin = part * kPartitionSize;
      const int64_t tok_end = std::min<int64_t>(p.seq_lens[seq], tok_begin + kPartitionSize);
      attend_range(p, seq, kv_head, tok_begin, tok_end, ws, acc.data(), row_max.data(),
                   row_sum.data());
      for (int64_t g = 0; g < group; ++g) {
        const int64_t idx = (seq * p.num_heads + kv_head * group + g) * max_parts + part;
        const float inv = 1.f / row_sum[g];
        for (int64_t d = 0; d < hs; ++d) tmp[idx * hs + d] = static_cast<T>(acc[g * hs + d] * inv);
        ml[idx] = row_max[g];
        es[idx] = row_sum[g];
      }
    }
  });

  // Pass 2: out = sum_p w_p * tmp_out_p / sum_p w_p, w_p = exp_sums_p * exp(max_logits_p - max).
  at::parallel_for(0, num_seqs * p.num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(hs), w(max_parts);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t seq = row / p.num_heads, head = row % p.num_heads;
      const int64_t n = num_parts(seq);
      std::fill(o.begin(), o.end(), 0.f);
      if (n > 0) {
        const float* row_ml = ml + row * max_parts;
        const float* row_es = es + row * max_parts;
        const float m = *std::max_element(row_ml, row_ml + n);
        float total = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          w[i] = row_es[i] * std::exp(row_ml[i] - m);
          total += w[i];
        }
        for (int64_t i = 0; i < n; ++i) {
          const float wi = w[i] / total;
          const T* part_out = tmp + (row * max_parts + i) * hs;
          for (int64_t d = 0; d < hs; ++d) o[d] += wi * static_cast<float>(part_out[d]);
        }
      }
      store_row<T>(out, seq, head, o.data(), hs);
    }
  });
}

}  // namespace

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, int64_t tp_rank,
                        int64_t blocksparse_local_blocks, int64_t blocksparse_vert_stride,
                        int64_t blocksparse_block_size, int64_t blocksparse_head_sliding_step) {
  (void)tp_rank;  // only blocksparse attention used these; dense attention ignores them
  (void)blocksparse_block_size;
  (void)blocksparse_head_sliding_step;
  const PagedAttentionV1V2Shape s = check_paged_attention_v1_v2_args(
      "paged_attention_v1", out, query, key_cache, value_cache, num_kv_heads, block_tables,
      seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
      blocksparse_local_blocks, blocksparse_vert_stride);
  TORCH_CHECK(query.device().is_cpu(), "paged_attention_v1: tensors must be on CPU");
  check_block_tables(s, block_tables, seq_lens, max_seq_len, "paged_attention_v1");
  PYORCH_CPU_DISPATCH_FLOATS(query.scalar_type(), "paged_attention_v1", [&] {
    if (s.kv_dtype == KVCacheDType::kFp8E4M3) {
      run_v1(make_problem<scalar_t, uint8_t>(s, query, key_cache, value_cache, block_tables,
                                             seq_lens, alibi_slopes, scale, k_scale, v_scale),
             s.num_seqs, out);
    } else {
      run_v1(make_problem<scalar_t, scalar_t>(s, query, key_cache, value_cache, block_tables,
                                              seq_lens, alibi_slopes, scale, k_scale, v_scale),
             s.num_seqs, out);
    }
  });
}

void paged_attention_v2(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                        at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, int64_t tp_rank,
                        int64_t blocksparse_local_blocks, int64_t blocksparse_vert_stride,
                        int64_t blocksparse_block_size, int64_t blocksparse_head_sliding_step) {
  (void)tp_rank;
  (void)blocksparse_block_size;
  (void)blocksparse_head_sliding_step;
  const PagedAttentionV1V2Shape s = check_paged_attention_v1_v2_args(
      "paged_attention_v2", out, query, key_cache, value_cache, num_kv_heads, block_tables,
      seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
      blocksparse_local_blocks, blocksparse_vert_stride);
  const int64_t max_parts =
      check_paged_attention_v2_scratch(s, query, exp_sums, max_logits, tmp_out, max_seq_len);
  TORCH_CHECK(query.device().is_cpu(), "paged_attention_v2: tensors must be on CPU");
  check_block_tables(s, block_tables, seq_lens, max_seq_len, "paged_attention_v2");
  PYORCH_CPU_DISPATCH_FLOATS(query.scalar_type(), "paged_attention_v2", [&] {
    if (s.kv_dtype == KVCacheDType::kFp8E4M3) {
      run_v2(make_problem<scalar_t, uint8_t>(s, query, key_cache, value_cache, block_tables,
                                             seq_lens, alibi_slopes, scale, k_scale, v_scale),
             s.num_seqs, max_parts, out, exp_sums, max_logits, tmp_out);
    } else {
      run_v2(make_problem<scalar_t, scalar_t>(s, query, key_cache, value_cache, block_tables,
                                              seq_lens, alibi_slopes, scale, k_scale, v_scale),
             s.num_seqs, max_parts, out, exp_sums, max_logits, tmp_out);
    }
  });
}

}  // namespace pyorch::cpu
