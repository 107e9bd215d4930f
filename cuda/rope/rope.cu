// Instantiates the rotary embedding kernel for each (query dtype, cache dtype) behind the C API.
#include <type_traits>

#include "pyorch/rope.h"
#include "rope/rotary_embedding.cuh"

namespace pyorch {

cudaError_t rotary_embedding(const int64_t* positions, void* query, void* key,
                             const void* cos_sin_cache, DType dtype, DType cache_dtype,
                             int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_size, int64_t rot_dim, int64_t query_token_stride,
                             int64_t query_head_stride, int64_t key_token_stride,
                             int64_t key_head_stride, int64_t cache_stride, bool is_neox,
                             cudaStream_t stream) {
  if (rot_dim <= 0 || rot_dim % 2 != 0 || rot_dim > head_size) {
    PYORCH_INVALID("rotary_embedding: rot_dim %lld must be even, positive and <= head_size %lld",
                   static_cast<long long>(rot_dim), static_cast<long long>(head_size));
  }
  if (key == nullptr) num_kv_heads = 0;
  // Head counts and in-head offsets are int on the device; strides and token indices are int64.
  if (num_heads < 0 || num_kv_heads < 0 || num_heads + num_kv_heads > (1 << 24) ||
      head_size > (1 << 24)) {
    PYORCH_INVALID("rotary_embedding: bad head counts or head_size");
  }
  auto run = [&](auto* q, auto* cache) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(q)>;
    using CacheT = std::remove_const_t<std::remove_pointer_t<decltype(cache)>>;
    kernels::RopeParams<T, CacheT> p{positions,
                                     q,
                                     static_cast<T*>(key),
                                     cache,
                                     num_tokens,
                                     static_cast<int>(num_heads),
                                     static_cast<int>(num_kv_heads),
                                     static_cast<int>(rot_dim / 2),
                                     query_token_stride,
                                     query_head_stride,
                                     key_token_stride,
                                     key_head_stride,
                                     cache_stride};
    return kernels::launch_rotary_embedding(p, is_neox, stream);
  };
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    T* q = static_cast<T*>(query);
    if (cache_dtype == DType::kFloat32) return run(q, static_cast<const float*>(cos_sin_cache));
    if (cache_dtype == dtype) return run(q, static_cast<const T*>(cos_sin_cache));
    PYORCH_INVALID("rotary_embedding: cos_sin_cache must be %s or float32, got %s",
                   dtype_name(dtype), dtype_name(cache_dtype));
  });
}

}  // namespace pyorch
