// CUDA adapters for paged_attention and merge_attn_states: check, guard, stream, workspace from the
// caching allocator, call cuda/, check status. No math here, and no host synchronization (both ops
// are captured in CUDA graphs).
#include <string>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "ops.h"
#include "pyorch/attention.h"

namespace {

bool is_half_type(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

void check_cuda_int32_vector(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(),
              "paged_attention: ", name, " must be a contiguous 1-D int32 CUDA tensor");
}

// The kernels copy query and cache rows paged_attention_copy_bytes at a time (16 bytes, 8 for an
// fp8 row of 120): base pointers and row strides must allow those copies.
void check_row_copies(const at::Tensor& t, std::initializer_list<int64_t> strides,
                      const char* name) {
  const int64_t copy_bytes = pyorch::paged_attention_copy_bytes(t.size(-1) * t.element_size());
  const int64_t elems_per_copy = copy_bytes / t.element_size();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % copy_bytes == 0,
              "paged_attention: ", name,
              " must be " + std::to_string(copy_bytes) + "-byte aligned");
  for (int64_t s : strides) {
    TORCH_CHECK(s % elems_per_copy == 0, "paged_attention: ", name,
                " strides must be multiples of " + std::to_string(copy_bytes) + " bytes");
  }
}

void check_cache(const at::Tensor& cache, const at::Tensor& key_cache,
                 pyorch::KVCacheDType kv_dtype, at::ScalarType model_dtype, const char* name) {
  TORCH_CHECK(cache.is_cuda() && cache.dim() == 4 && cache.stride(3) == 1,
              "paged_attention: ", name,
              " must be a CUDA [num_blocks, block_size, num_kv_heads, head_size] tensor "
              "with a contiguous last dimension");
  TORCH_CHECK(cache.sizes() == key_cache.sizes(),
              "paged_attention: key_cache and value_cache "
              "shapes differ");
  pyorch::check_kv_cache_dtype(cache, kv_dtype, model_dtype, "paged_attention");
  check_row_copies(cache, {cache.stride(0), cache.stride(1), cache.stride(2)}, name);
}

const float* scale_ptr(const at::Tensor& scale, pyorch::KVCacheDType kv_dtype, const char* name) {
  if (kv_dtype == pyorch::KVCacheDType::kAuto) return nullptr;
  TORCH_CHECK(scale.is_cuda() && scale.scalar_type() == at::kFloat && scale.numel() == 1,
              "paged_attention: ", name, " must be a one-element float32 CUDA tensor");
  return scale.const_data_ptr<float>();
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, const at::Tensor& block_table,
                     int64_t max_query_len, int64_t max_seq_len, double scale, bool causal,
                     int64_t sliding_window, double logits_soft_cap,
                     const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                     const at::Tensor& v_scale, const std::optional<at::Tensor>& lse) {
  TORCH_CHECK(query.is_cuda() && out.is_cuda(), "paged_attention: query and out must be on CUDA");
  TORCH_CHECK(is_half_type(query.scalar_type()),
              "paged_attention: query must be float16 or "
              "bfloat16 on CUDA, got ",
              query.scalar_type());
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1,
              "paged_attention: query must be "
              "[num_tokens, num_heads, head_size] with a contiguous last dimension");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() &&
                  out.stride(2) == 1,
              "paged_attention: out must match query's shape and dtype");
  const int64_t head_size = query.size(2);
  // The kernels' own list (cuda/attention/attention.cu), not a copy of it.
  TORCH_CHECK(pyorch::paged_attention_supports_head_size(head_size),
              // std::to_string: formatting an integer through c10::str segfaulted in the
              // GPU machine's build (ostream<<long inside _C.so); see the attention report.
              "Unsupported head size: " + std::to_string(head_size));
  const auto kv_dtype = pyorch::parse_kv_cache_dtype(kv_cache_dtype);
  check_cache(key_cache, key_cache, kv_dtype, query.scalar_type(), "key_cache");
  check_cache(value_cache, key_cache, kv_dtype, query.scalar_type(), "value_cache");
  TORCH_CHECK(key_cache.size(3) == head_size, "paged_attention: cache head_size ",
              key_cache.size(3), " != query head_size ", head_size);
  const int64_t num_heads = query.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "paged_attention: num_heads ",
              num_heads, " is not a multiple of num_kv_heads ", num_kv_heads);
  check_cuda_int32_vector(query_start_loc, "query_start_loc");
  check_cuda_int32_vector(seq_lens, "seq_lens");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1,
              "paged_attention: query_start_loc must hold num_seqs + 1 entries");
  TORCH_CHECK(block_table.is_cuda() && block_table.scalar_type() == at::kInt &&
                  block_table.dim() == 2 && block_table.size(0) >= num_seqs &&
                  block_table.stride(1) == 1,
              "paged_attention: block_table must be an int32 CUDA [num_seqs, max_blocks] tensor");
  check_row_copies(query, {query.stride(0), query.stride(1)}, "query");
  TORCH_CHECK(out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0,
              "paged_attention: out rows must be 4-byte aligned");

  pyorch::PagedAttentionParams p{};
  p.out = out.data_ptr();
  p.query = query.const_data_ptr();
  p.key_cache = key_cache.const_data_ptr();
  p.value_cache = value_cache.const_data_ptr();
  p.query_start_loc = query_start_loc.const_data_ptr<int32_t>();
  p.seq_lens = seq_lens.const_data_ptr<int32_t>();
  p.block_table = block_table.const_data_ptr<int32_t>();
  p.k_scale = scale_ptr(k_scale, kv_dtype, "k_scale");
  p.v_scale = scale_ptr(v_scale, kv_dtype, "v_scale");
  p.dtype = pyorch::to_pyorch_dtype(query.scalar_type());
  p.kv_cache_dtype = kv_dtype;
  p.num_tokens = query.size(0);
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_size = head_size;
  p.block_size = key_cache.size(1);
  p.max_blocks_per_seq = block_table.size(1);
  p.block_table_stride = block_table.stride(0);
  p.q_token_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.k_block_stride = key_cache.stride(0);
  p.k_token_stride = key_cache.stride(1);
  p.k_head_stride = key_cache.stride(2);
  p.v_block_stride = value_cache.stride(0);
  p.v_token_stride = value_cache.stride(1);
  p.v_head_stride = value_cache.stride(2);
  p.max_query_len = max_query_len;
  p.max_seq_len = max_seq_len;
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.sliding_window = static_cast<int32_t>(sliding_window);
  p.logits_soft_cap = static_cast<float>(logits_soft_cap);
  if (lse.has_value()) {
    pyorch::check_lse_out(*lse, query, "CUDA");
    p.lse = lse->data_ptr<float>();
    p.lse_head_stride = lse->stride(0);
  }

  const c10::cuda::OptionalCUDAGuard guard(query.device());
  // The caching allocator hands out the workspace without a sync, also under graph capture.
  const size_t workspace_bytes = pyorch::paged_attention_workspace_size(p);
  at::Tensor workspace;
  if (workspace_bytes > 0) {
    workspace =
        at::empty({static_cast<int64_t>(workspace_bytes)}, query.options().dtype(at::kByte));
  }
  PYORCH_CHECK_CUDA(pyorch::paged_attention(p, workspace_bytes > 0 ? workspace.data_ptr() : nullptr,
                                            workspace_bytes, c10::cuda::getCurrentCUDAStream()));
}

void merge_attn_states(at::Tensor& output, std::optional<at::Tensor> output_lse,
                       const at::Tensor& prefix_output, const at::Tensor& prefix_lse,
                       const at::Tensor& suffix_output, const at::Tensor& suffix_lse) {
  TORCH_CHECK(output.is_cuda() && prefix_output.is_cuda() && suffix_output.is_cuda() &&
                  prefix_lse.is_cuda() && suffix_lse.is_cuda(),
              "merge_attn_states: tensors must be on CUDA");
  TORCH_CHECK(output.dim() == 3 && output.stride(2) == 1,
              "merge_attn_states: output must be "
              "[num_tokens, num_heads, head_size] with a contiguous last dimension");
  for (const at::Tensor* t : {&prefix_output, &suffix_output}) {
    TORCH_CHECK(t->sizes() == output.sizes() && t->scalar_type() == output.scalar_type() &&
                    t->stride(2) == 1,
                "merge_attn_states: prefix/suffix outputs must match output's shape and dtype");
  }
  const auto dtype = output.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "merge_attn_states: outputs must be float32, float16 or bfloat16, got ", dtype);
  const int64_t num_tokens = output.size(0);
  const int64_t num_heads = output.size(1);
  std::vector<const at::Tensor*> lses = {&prefix_lse, &suffix_lse};
  if (output_lse.has_value()) lses.push_back(&*output_lse);
  for (const at::Tensor* t : lses) {
    TORCH_CHECK(
        t->is_cuda() && t->scalar_type() == at::kFloat && t->dim() == 2 &&
            t->size(0) == num_heads && t->size(1) == num_tokens && t->is_contiguous(),
        "merge_attn_states: lse tensors must be contiguous float32 [num_heads, num_tokens]");
  }
  const c10::cuda::OptionalCUDAGuard guard(output.device());
  PYORCH_CHECK_CUDA(pyorch::merge_attn_states(
      output.data_ptr(), output_lse.has_value() ? output_lse->data_ptr<float>() : nullptr,
      prefix_output.const_data_ptr(), prefix_lse.const_data_ptr<float>(),
      suffix_output.const_data_ptr(), suffix_lse.const_data_ptr<float>(),
      pyorch::to_pyorch_dtype(output.scalar_type()), num_tokens, num_heads, output.size(2),
      output.stride(0), output.stride(1), prefix_output.stride(0), prefix_output.stride(1),
      suffix_output.stride(0), suffix_output.stride(1), num_tokens,
      c10::cuda::getCurrentCUDAStream()));
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
  TORCH_CHECK(perm.is_cuda() && perm.device() == query.device() &&
                  perm.scalar_type() == at::kLong && perm.dim() == 1 && perm.is_contiguous(),
              "cascade_attention: perm must be a contiguous 1-D int64 tensor on query's device");
  TORCH_CHECK(prefix_query_start_loc.size(0) >= 1 && perm.size(0) <= query.size(0),
              "cascade_attention: perm holds more rows than query");
  const c10::cuda::OptionalCUDAGuard guard(query.device());
  const int64_t num_tokens = query.size(0);
  const int64_t num_heads = query.size(1);
  const auto f32 = query.options().dtype(at::kFloat);
  // Every row's own suffix, straight into out (paged_attention checks the shared arguments).
  at::Tensor suffix_lse = at::empty({num_heads, num_tokens}, f32);
  paged_attention(out, query, key_cache, value_cache, query_start_loc, suffix_seq_lens,
                  suffix_block_table, max_query_len, suffix_max_seq_len, scale, /*causal=*/true,
                  /*sliding_window=*/0, logits_soft_cap, kv_cache_dtype, k_scale, v_scale,
                  suffix_lse);
  const int64_t grouped = perm.size(0);
  if (grouped == 0) return;
  // Each group's prefix once, its members' queries as one sequence: every prefix key precedes
  // every query, so not causal.
  at::Tensor grouped_query = at::index_select(query, 0, perm);
  at::Tensor prefix_out = at::empty_like(grouped_query, at::MemoryFormat::Contiguous);
  at::Tensor prefix_lse = at::empty({num_heads, grouped}, f32);
  paged_attention(prefix_out, grouped_query, key_cache, value_cache, prefix_query_start_loc,
                  prefix_seq_lens, prefix_block_table, prefix_max_query_len, prefix_max_seq_len,
                  scale, /*causal=*/false, /*sliding_window=*/0, logits_soft_cap, kv_cache_dtype,
                  k_scale, v_scale, prefix_lse);
  PYORCH_CHECK_CUDA(pyorch::merge_prefix_into_rows(
      out.data_ptr(), suffix_lse.const_data_ptr<float>(), num_tokens, prefix_out.const_data_ptr(),
      prefix_lse.const_data_ptr<float>(), grouped, perm.const_data_ptr<int64_t>(), grouped,
      num_tokens, pyorch::to_pyorch_dtype(out.scalar_type()), num_heads, out.size(2), out.stride(0),
      out.stride(1), prefix_out.stride(0), prefix_out.stride(1),
      c10::cuda::getCurrentCUDAStream()));
}
