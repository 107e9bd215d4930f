// Argument checks of paged_attention_v1 / paged_attention_v2, shared by the CPU kernel
// (cpp/cpu/paged_attention_v1_v2.cpp) and the CUDA adapter (cpp/ops/paged_attention_v1_v2.cpp),
// so that both backends accept and reject the same calls with the same messages.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "common.h"
#include "pyorch/paged_attention_v1_v2_sizes.h"  // CUDA-free: the head sizes and the partition

namespace pyorch {

// Sizes read off checked arguments.
struct PagedAttentionV1V2Shape {
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t x;  // elements per 16-byte group of the key layout
  int64_t num_blocks;
  int64_t max_blocks_per_seq;
  KVCacheDType kv_dtype;
};

// Checks the split-layout caches against the sizes in s and fills s.x and s.num_blocks.
inline void check_paged_attention_v1_v2_caches(const char* op, PagedAttentionV1V2Shape& s,
                                               const at::Tensor& key_cache,
                                               const at::Tensor& value_cache,
                                               at::ScalarType dtype) {
  const int64_t num_kv_heads = s.num_kv_heads, block_size = s.block_size;
  check_kv_cache_dtype(key_cache, s.kv_dtype, dtype, op);
  check_kv_cache_dtype(value_cache, s.kv_dtype, dtype, op);
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), op,
              ": key_cache and value_cache dtypes differ");
  s.x = 16 / static_cast<int64_t>(key_cache.element_size());
  TORCH_CHECK(s.head_size % s.x == 0, op, ": head_size ", s.head_size,
              " is not a multiple of x = ", s.x, " for this cache dtype");
  TORCH_CHECK(key_cache.dim() == 5 && key_cache.size(1) == num_kv_heads &&
                  key_cache.size(2) == s.head_size / s.x && key_cache.size(3) == block_size &&
                  key_cache.size(4) == s.x,
              op, ": key_cache must be [num_blocks, ", num_kv_heads, ", ", s.head_size / s.x, ", ",
              block_size, ", ", s.x, "], got ", key_cache.sizes());
  TORCH_CHECK(key_cache.stride(4) == 1 && key_cache.stride(3) == s.x &&
                  key_cache.stride(2) == block_size * s.x,
              op, ": each (block, kv head) of key_cache must be contiguous");
  s.num_blocks = key_cache.size(0);
  TORCH_CHECK(value_cache.dim() == 4 && value_cache.size(0) == s.num_blocks &&
                  value_cache.size(1) == num_kv_heads && value_cache.size(2) == s.head_size &&
                  value_cache.size(3) == block_size,
              op, ": value_cache must be [", s.num_blocks, ", ", num_kv_heads, ", ", s.head_size,
              ", ", block_size, "], got ", value_cache.sizes());
  TORCH_CHECK(value_cache.stride(3) == 1 && value_cache.stride(2) == block_size, op,
              ": each (block, kv head) of value_cache must be contiguous");
}

// out/query: [num_seqs, num_heads, head_size]; key_cache: [num_blocks, num_kv_heads,
// head_size / x, block_size, x]; value_cache: [num_blocks, num_kv_heads, head_size, block_size];
// block_tables: [num_seqs, max_blocks_per_seq] int32; seq_lens: [num_seqs] int32;
// alibi_slopes: [num_heads] float32; k_scale/v_scale: one float32 each (read for fp8 only).
inline PagedAttentionV1V2Shape check_paged_attention_v1_v2_args(
    const char* op, const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, int64_t num_kv_heads, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
    const std::optional<at::Tensor>& alibi_slopes, const std::string& kv_cache_dtype,
    const at::Tensor& k_scale, const at::Tensor& v_scale, int64_t blocksparse_local_blocks,
    int64_t blocksparse_vert_stride) {
  TORCH_CHECK(
      blocksparse_vert_stride <= 1 && blocksparse_local_blocks == 0, op,
      ": blocksparse attention is not supported (blocksparse_vert_stride=", blocksparse_vert_stride,
      ", blocksparse_local_blocks=", blocksparse_local_blocks, ")");
  PagedAttentionV1V2Shape s{};
  TORCH_CHECK(query.dim() == 3, op, ": query must be [num_seqs, num_heads, head_size]");
  s.num_seqs = query.size(0);
  s.num_heads = query.size(1);
  s.head_size = query.size(2);
  TORCH_CHECK(paged_attention_v1_v2_head_size_supported(s.head_size),
              "Unsupported head size: ", s.head_size);
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": query must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(query.stride(2) == 1, op, ": query's last dimension must be contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == dtype && out.stride(2) == 1, op,
              ": out must match query's shape and dtype, with a contiguous last dimension");
  TORCH_CHECK(num_kv_heads > 0 && s.num_heads % num_kv_heads == 0, op, ": num_heads (", s.num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  s.num_kv_heads = num_kv_heads;
  TORCH_CHECK(block_size == 8 || block_size == 16 || block_size == 32,
              "Unsupported block size: ", block_size);
  s.block_size = block_size;
  TORCH_CHECK(max_seq_len >= 0, op, ": max_seq_len must be >= 0");

  s.kv_dtype = parse_kv_cache_dtype(kv_cache_dtype);
  check_paged_attention_v1_v2_caches(op, s, key_cache, value_cache, dtype);

  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == s.num_seqs &&
                  (block_tables.size(1) <= 1 || block_tables.stride(1) == 1),
              op,
              ": block_tables must be int32 [num_seqs, max_blocks_per_seq] with contiguous rows");
  s.max_blocks_per_seq = block_tables.size(1);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == s.num_seqs && seq_lens.is_contiguous(),
              op, ": seq_lens must be int32 [num_seqs], contiguous");
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.dim() == 1 && a.size(0) == s.num_heads &&
                    a.is_contiguous() && a.device() == query.device(),
                op, ": alibi_slopes must be float32 [num_heads], contiguous, on query's device");
  }
  if (s.kv_dtype == KVCacheDType::kFp8E4M3) {
    for (const at::Tensor* t : {&k_scale, &v_scale}) {
      TORCH_CHECK(
          t->numel() == 1 && t->scalar_type() == at::kFloat && t->device() == query.device(), op,
          ": k_scale and v_scale must be one float32 element on query's device");
    }
  }
  for (const at::Tensor* t : {&out, &key_cache, &value_cache, &block_tables, &seq_lens}) {
    TORCH_CHECK(t->device() == query.device(), op, ": all tensors must be on query's device");
  }
  return s;
}

// v2 scratch. exp_sums, max_logits: [num_seqs, num_heads, max_num_partitions] float32;
// tmp_out: [num_seqs, num_heads, max_num_partitions, head_size] of query's dtype; all contiguous,
// with max_num_partitions >= ceil(max_seq_len / 512). Returns max_num_partitions.
inline int64_t check_paged_attention_v2_scratch(const PagedAttentionV1V2Shape& s,
                                                const at::Tensor& query, const at::Tensor& exp_sums,
                                                const at::Tensor& max_logits,
                                                const at::Tensor& tmp_out, int64_t max_seq_len) {
  const int64_t needed =
      (max_seq_len + kPagedAttentionV2PartitionSize - 1) / kPagedAttentionV2PartitionSize;
  TORCH_CHECK(exp_sums.dim() == 3, "paged_attention_v2: exp_sums must be 3-D");
  const int64_t parts = exp_sums.size(2);
  for (const at::Tensor* t : {&exp_sums, &max_logits}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == s.num_seqs &&
                    t->size(1) == s.num_heads && t->size(2) == parts && t->is_contiguous() &&
                    t->device() == query.device(),
                "paged_attention_v2: exp_sums and max_logits must be contiguous float32 [",
                s.num_seqs, ", ", s.num_heads, ", max_num_partitions]");
  }
  TORCH_CHECK(tmp_out.scalar_type() == query.scalar_type() && tmp_out.dim() == 4 &&
                  tmp_out.size(0) == s.num_seqs && tmp_out.size(1) == s.num_heads &&
                  tmp_out.size(2) == parts && tmp_out.size(3) == s.head_size &&
                  tmp_out.is_contiguous() && tmp_out.device() == query.device(),
              "paged_attention_v2: tmp_out must be contiguous [", s.num_seqs, ", ", s.num_heads,
              ", max_num_partitions, ", s.head_size, "] of query's dtype");
  TORCH_CHECK(parts >= needed, "paged_attention_v2: max_num_partitions (", parts,
              ") must be at least ceil(max_seq_len / 512) = ", needed);
  return parts;
}

}  // namespace pyorch
