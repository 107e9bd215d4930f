// CUDA adapters for vLLM's paged_attention_v1 / paged_attention_v2: check, guard, stream, call
// cuda/. No math here, and no host sync: k_scale / v_scale reach the kernel as device pointers.
#include <climits>
#include <cstdint>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "ops.h"
#include "paged_attention_v1_v2_checks.h"
#include "pyorch/paged_attention_v1_v2.h"

namespace {

// The C API's arguments from checked tensors, plus the CUDA-only requirements (16-byte vector
// loads from both caches).
pyorch::PagedAttentionV1V2Args make_args(const pyorch::PagedAttentionV1V2Shape& s, const char* op,
                                         at::Tensor& out, const at::Tensor& query,
                                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                         const std::optional<at::Tensor>& alibi_slopes,
                                         const at::Tensor& k_scale, const at::Tensor& v_scale,
                                         double scale, int64_t max_seq_len) {
  TORCH_CHECK(query.is_cuda(), op, ": tensors must be on CUDA");
  for (const at::Tensor* cache : {&key_cache, &value_cache}) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(cache->data_ptr()) % 16 == 0 &&
                    cache->stride(0) % s.x == 0 && cache->stride(1) % s.x == 0,
                op, ": each (block, kv head) of the caches must start on a 16-byte boundary");
  }
  TORCH_CHECK(max_seq_len <= INT_MAX && s.num_seqs <= INT_MAX && s.num_heads <= INT_MAX, op,
              ": sizes exceed int32");
  const bool fp8 = s.kv_dtype == pyorch::KVCacheDType::kFp8E4M3;
  pyorch::PagedAttentionV1V2Args a{};
  a.out = out.data_ptr();
  a.query = query.data_ptr();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  a.k_scale = fp8 ? k_scale.data_ptr<float>() : nullptr;
  a.v_scale = fp8 ? v_scale.data_ptr<float>() : nullptr;
  a.dtype = pyorch::to_pyorch_dtype(query.scalar_type());
  a.kv_cache_dtype = s.kv_dtype;
  a.num_seqs = static_cast<int>(s.num_seqs);
  a.num_heads = static_cast<int>(s.num_heads);
  a.num_kv_heads = static_cast<int>(s.num_kv_heads);
  a.head_size = static_cast<int>(s.head_size);
  a.block_size = static_cast<int>(s.block_size);
  a.max_seq_len = static_cast<int>(max_seq_len);
  a.scale = static_cast<float>(scale);
  a.q_seq_stride = query.stride(0);
  a.q_head_stride = query.stride(1);
  a.out_seq_stride = out.stride(0);
  a.out_head_stride = out.stride(1);
  a.k_block_stride = key_cache.stride(0);
  a.k_head_stride = key_cache.stride(1);
  a.v_block_stride = value_cache.stride(0);
  a.v_head_stride = value_cache.stride(1);
  a.block_table_stride = block_tables.stride(0);
  return a;
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
  const char* op = "paged_attention_v1";
  const pyorch::PagedAttentionV1V2Shape s = pyorch::check_paged_attention_v1_v2_args(
      op, out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens, block_size,
      max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, blocksparse_local_blocks,
      blocksparse_vert_stride);
  const pyorch::PagedAttentionV1V2Args args =
      make_args(s, op, out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                k_scale, v_scale, scale, max_seq_len);
  if (s.num_seqs == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(query.device());
  PYORCH_CHECK_CUDA(pyorch::paged_attention_v1(args, c10::cuda::getCurrentCUDAStream()));
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
  const char* op = "paged_attention_v2";
  const pyorch::PagedAttentionV1V2Shape s = pyorch::check_paged_attention_v1_v2_args(
      op, out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens, block_size,
      max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, blocksparse_local_blocks,
      blocksparse_vert_stride);
  const int64_t max_parts = pyorch::check_paged_attention_v2_scratch(s, query, exp_sums, max_logits,
                                                                     tmp_out, max_seq_len);
  const pyorch::PagedAttentionV1V2Args args =
      make_args(s, op, out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                k_scale, v_scale, scale, max_seq_len);
  if (s.num_seqs == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(query.device());
  PYORCH_CHECK_CUDA(pyorch::paged_attention_v2(args, exp_sums.data_ptr<float>(),
                                               max_logits.data_ptr<float>(), tmp_out.data_ptr(),
                                               max_parts, c10::cuda::getCurrentCUDAStream()));
}
