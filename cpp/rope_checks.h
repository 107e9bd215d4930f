// Argument checks shared by the CPU kernel (cpp/cpu/rope.cpp) and the CUDA adapter
// (cpp/ops/rope.cpp) of rotary_embedding, so both backends accept and reject the same inputs.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "cache_checks.h"

namespace pyorch {

// A query or key tensor seen as [num_tokens, num_heads, head_size] with element strides.
struct HeadsView {
  int64_t num_heads;
  int64_t token_stride;
  int64_t head_stride;
};

// Accepts [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size], whose token
// (and head) strides may be anything, e.g. a slice of a fused qkv projection.
inline HeadsView heads_view(const at::Tensor& x, int64_t num_tokens, int64_t head_size,
                            const char* name) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "rotary_embedding: ", name,
              " must be [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size]");
  TORCH_CHECK(x.size(0) == num_tokens, "rotary_embedding: ", name, " has ", x.size(0),
              " tokens but positions has ", num_tokens);
  TORCH_CHECK(x.size(-1) <= 1 || x.stride(-1) == 1, "rotary_embedding: the last dimension of ",
              name, " must be contiguous");
  if (x.dim() == 3) {
    TORCH_CHECK(x.size(2) == head_size, "rotary_embedding: ", name, " head size ", x.size(2),
                " != head_size ", head_size);
    // A lone head's stride is meaningless; the natural one keeps the vector-width check happy.
    return {x.size(1), x.stride(0), x.size(1) == 1 ? head_size : x.stride(1)};
  }
  TORCH_CHECK(x.size(1) % head_size == 0, "rotary_embedding: ", name, " width ", x.size(1),
              " is not a multiple of head_size ", head_size);
  return {x.size(1) / head_size, x.stride(0), head_size};
}

// Checks query's dtype, head_size and cos_sin_cache ([max_position, rot_dim], rows contiguous, in
// query's dtype or float32); returns rot_dim.
inline int64_t check_rope_args(const at::Tensor& query, int64_t head_size,
                               const at::Tensor& cos_sin_cache) {
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "rotary_embedding: query dtype must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(head_size > 0, "rotary_embedding: head_size must be positive");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.stride(1) == 1,
              "rotary_embedding: cos_sin_cache must be [max_position, rot_dim], rows contiguous");
  TORCH_CHECK(cos_sin_cache.scalar_type() == dtype || cos_sin_cache.scalar_type() == at::kFloat,
              "rotary_embedding: cos_sin_cache dtype must be ", dtype, " or float32, got ",
              cos_sin_cache.scalar_type());
  const int64_t rot_dim = cos_sin_cache.size(1);
  TORCH_CHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= head_size,
              "rotary_embedding: rot_dim (cos_sin_cache.size(1) = ", rot_dim,
              ") must be even, positive and <= head_size ", head_size);
  return rot_dim;
}

// What rotary_embedding_and_cache needs once its arguments pass both ops' checks.
struct RopeCacheShape {
  int64_t rot_dim;
  HeadsView query;
  HeadsView key;
  CacheWriteShape cache;
};

// rotary_embedding's checks on (positions, query, key, cos_sin_cache) and
// reshape_and_cache_flash's on (key, value, caches, slot_mapping, scales), with key and value as
// [num_tokens, num_kv_heads, head_size] and everything on query's device.
inline RopeCacheShape check_rope_and_cache(
    const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, int64_t head_size, const at::Tensor& cos_sin_cache,
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const std::string& kv_cache_dtype, const at::Tensor& k_scale, const at::Tensor& v_scale) {
  constexpr const char* kOp = "rotary_embedding_and_cache";
  const int64_t rot_dim = check_rope_args(query, head_size, cos_sin_cache);
  TORCH_CHECK(
      positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous(),
      kOp, ": positions must be a contiguous [num_tokens] int64 tensor");
  const int64_t num_tokens = positions.size(0);
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), kOp, ": key dtype ", key.scalar_type(),
              " != query dtype ", query.scalar_type());
  const CacheWriteShape cache =
      check_cache_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                        v_scale, CacheLayout::kFlash, kOp);
  TORCH_CHECK(cache.head_size == head_size, kOp, ": key head size ", cache.head_size,
              " != head_size ", head_size);
  check_same_device(query, "query", key, "key", kOp);
  check_same_device(positions, "positions", key, "key", kOp);
  check_same_device(cos_sin_cache, "cos_sin_cache", key, "key", kOp);
  return {rot_dim, heads_view(query, num_tokens, head_size, "query"),
          heads_view(key, num_tokens, head_size, "key"), cache};
}

// rotary_embedding_and_cache's optional q/k norm weights: both or neither, each a contiguous
// [head_size] tensor in query's dtype on query's device, with whole heads rotating (rot_dim ==
// head_size) and head_size a power of two (how the CUDA kernel splits a head over a group of
// threads). Returns whether they are given.
inline bool check_qk_norm(const at::Tensor& query, const std::optional<at::Tensor>& q_norm_weight,
                          const std::optional<at::Tensor>& k_norm_weight, int64_t head_size,
                          int64_t rot_dim) {
  constexpr const char* kOp = "rotary_embedding_and_cache";
  TORCH_CHECK(q_norm_weight.has_value() == k_norm_weight.has_value(), kOp,
              ": q_norm_weight and k_norm_weight go together (both or neither)");
  if (!q_norm_weight.has_value()) return false;
  for (const at::Tensor* w : {&*q_norm_weight, &*k_norm_weight}) {
    const char* name = w == &*q_norm_weight ? "q_norm_weight" : "k_norm_weight";
    TORCH_CHECK(w->dim() == 1 && w->size(0) == head_size && w->is_contiguous(), kOp, ": ", name,
                " must be a contiguous [head_size = ", head_size, "] tensor, got ", w->sizes());
    TORCH_CHECK(w->scalar_type() == query.scalar_type(), kOp, ": ", name, " dtype ",
                w->scalar_type(), " != query dtype ", query.scalar_type());
    TORCH_CHECK(w->device() == query.device(), kOp, ": ", name, " is on ", w->device(),
                ", query on ", query.device());
  }
  TORCH_CHECK(rot_dim == head_size, kOp, ": the q/k norm needs whole heads to rotate (rot_dim ",
              rot_dim, " != head_size ", head_size, ")");
  TORCH_CHECK(head_size >= 2 && (head_size & (head_size - 1)) == 0, kOp,
              ": the q/k norm needs a power-of-two head_size, got ", head_size);
  return true;
}

}  // namespace pyorch
