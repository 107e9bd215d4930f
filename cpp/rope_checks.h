// Argument checks shared by the CPU kernel (cpp/cpu/rope.cpp) and the CUDA adapter
// (cpp/ops/rope.cpp) of rotary_embedding, so both backends accept and reject the same inputs.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace pyorch {

// A query or key tensor seen as [num_tokens, num_heads, head_size] with element strides.
struct HeadsView {
  int64_t num_heads;
  int64_t token_stride;
  int64_t head_stride;
};

// Accepts [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size], whose token
// (and head) strides may be anything, e.g. a slice of a fused qkv projection.
inline HeadsView heads_view(const at::Tensor& x, int64_t num_tokens, int64_t head_size, const char* name) {
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

}  // namespace pyorch
