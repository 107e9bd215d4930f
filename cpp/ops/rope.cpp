// CUDA adapter for rotary_embedding: check, guard, stream, call cuda/, check status. No math here.
#include <cstdint>
#include <initializer_list>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "ops.h"
#include "pyorch/rope.h"
#include "rope_checks.h"

using pyorch::heads_view;
using pyorch::HeadsView;

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, std::optional<at::Tensor> key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  TORCH_CHECK(positions.is_cuda() && query.is_cuda() && cos_sin_cache.is_cuda(),
              "rotary_embedding: tensors must be on CUDA");
  TORCH_CHECK(
      positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous(),
      "rotary_embedding: positions must be a contiguous [num_tokens] int64 tensor");
  const at::ScalarType dtype = query.scalar_type();
  const int64_t rot_dim = pyorch::check_rope_args(query, head_size, cos_sin_cache);
  const int64_t num_tokens = positions.size(0);
  const HeadsView q = heads_view(query, num_tokens, head_size, "query");
  HeadsView k{0, 0, 0};
  if (key.has_value()) {
    TORCH_CHECK(key->is_cuda() && key->device() == query.device(),
                "rotary_embedding: key must be on query's device");
    TORCH_CHECK(key->scalar_type() == dtype, "rotary_embedding: key dtype must match query");
    k = heads_view(*key, num_tokens, head_size, "key");
  }
  const c10::cuda::OptionalCUDAGuard guard(query.device());
  PYORCH_CHECK_CUDA(pyorch::rotary_embedding(
      positions.const_data_ptr<int64_t>(), query.data_ptr(),
      key.has_value() ? key->data_ptr() : nullptr, cos_sin_cache.const_data_ptr(),
      pyorch::to_pyorch_dtype(dtype), pyorch::to_pyorch_dtype(cos_sin_cache.scalar_type()),
      num_tokens, q.num_heads, k.num_heads, head_size, rot_dim, q.token_stride, q.head_stride,
      k.token_stride, k.head_stride, cos_sin_cache.stride(0), is_neox,
      c10::cuda::getCurrentCUDAStream()));
}

void rotary_embedding_and_cache(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                                const at::Tensor& value, int64_t head_size,
                                const at::Tensor& cos_sin_cache, bool is_neox,
                                at::Tensor& key_cache, at::Tensor& value_cache,
                                const at::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                                const at::Tensor& k_scale, const at::Tensor& v_scale,
                                const std::optional<at::Tensor>& q_norm_weight,
                                const std::optional<at::Tensor>& k_norm_weight, double norm_eps) {
  const pyorch::RopeCacheShape s = pyorch::check_rope_and_cache(
      positions, query, key, value, head_size, cos_sin_cache, key_cache, value_cache, slot_mapping,
      kv_cache_dtype, k_scale, v_scale);
  const bool qk_norm =
      pyorch::check_qk_norm(query, q_norm_weight, k_norm_weight, head_size, s.rot_dim);
  if (qk_norm) {
    // The kernel's norm form splits a head into 16-byte chunks, one per thread of a group of at
    // most a warp: every pointer and stride it reads with must allow that width.
    const int64_t vec = 16 / query.element_size();
    bool aligned = true;
    const std::initializer_list<const at::Tensor*> tensors = {
        &query, &key, &value, &key_cache, &value_cache, &*q_norm_weight, &*k_norm_weight};
    for (const at::Tensor* t : tensors) {
      aligned = aligned && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0;
    }
    aligned = aligned && s.query.token_stride % vec == 0 && s.query.head_stride % vec == 0 &&
              s.key.token_stride % vec == 0 && s.key.head_stride % vec == 0 &&
              value.stride(0) % vec == 0 && value.stride(1) % vec == 0 &&
              key_cache.stride(0) % vec == 0 && key_cache.stride(1) % vec == 0 &&
              key_cache.stride(2) % vec == 0;
    TORCH_CHECK(aligned && head_size / 2 / vec <= 32,
                "rotary_embedding_and_cache: the q/k norm on CUDA needs 16-byte aligned query, "
                "key, value, caches and norm weights with strides of whole 16-byte vectors, and "
                "head_size <= ",
                64 * vec, " (got head_size ", head_size, ")");
  }
  TORCH_CHECK(query.is_cuda(), "rotary_embedding_and_cache: tensors must be on CUDA, got ",
              query.device());
  const bool fp8 = s.cache.kv_cache_dtype == pyorch::KVCacheDType::kFp8E4M3;
  const c10::cuda::OptionalCUDAGuard guard(query.device());
  PYORCH_CHECK_CUDA(pyorch::rotary_embedding_and_cache(
      positions.const_data_ptr<int64_t>(), query.data_ptr(), key.data_ptr(), value.const_data_ptr(),
      cos_sin_cache.const_data_ptr(), pyorch::to_pyorch_dtype(query.scalar_type()),
      pyorch::to_pyorch_dtype(cos_sin_cache.scalar_type()), s.cache.num_tokens, s.query.num_heads,
      s.key.num_heads, head_size, s.rot_dim, s.query.token_stride, s.query.head_stride,
      s.key.token_stride, s.key.head_stride, value.stride(0), value.stride(1),
      cos_sin_cache.stride(0), is_neox, key_cache.data_ptr(), value_cache.data_ptr(),
      slot_mapping.const_data_ptr<int64_t>(), fp8 ? k_scale.const_data_ptr<float>() : nullptr,
      fp8 ? v_scale.const_data_ptr<float>() : nullptr, s.cache.kv_cache_dtype, s.cache.num_blocks,
      s.cache.block_size, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
      qk_norm ? q_norm_weight->const_data_ptr() : nullptr,
      qk_norm ? k_norm_weight->const_data_ptr() : nullptr, static_cast<float>(norm_eps),
      c10::cuda::getCurrentCUDAStream()));
}
