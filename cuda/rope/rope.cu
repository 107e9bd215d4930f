// Instantiates the rotary embedding kernel for each (query dtype, cache dtype) behind the C API.
#include <type_traits>

#include "pyorch/rope.h"
#include "rope/rotary_embedding.cuh"
#include "rope/rotary_embedding_and_cache.cuh"

namespace pyorch {
namespace {

cudaError_t check_rope_sizes(int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                             int64_t rot_dim) {
  if (rot_dim <= 0 || rot_dim % 2 != 0 || rot_dim > head_size) {
    PYORCH_INVALID("rotary_embedding: rot_dim %lld must be even, positive and <= head_size %lld",
                   static_cast<long long>(rot_dim), static_cast<long long>(head_size));
  }
  // Head counts and in-head offsets are int on the device; strides and token indices are int64.
  if (num_heads < 0 || num_kv_heads < 0 || num_heads + num_kv_heads > (1 << 24) ||
      head_size > (1 << 24)) {
    PYORCH_INVALID("rotary_embedding: bad head counts or head_size");
  }
  return cudaSuccess;
}

// The sizes and strides both entry points pass to the kernel's RopeParams.
struct RopeLayout {
  const int64_t* positions;
  void* key;
  int64_t num_tokens, num_heads, num_kv_heads, rot_dim;
  int64_t query_token_stride, query_head_stride, key_token_stride, key_head_stride, cache_stride;
};

template <typename T, typename CosSinT>
kernels::RopeParams<T, CosSinT> rope_params(const RopeLayout& l, T* query, const CosSinT* cos_sin) {
  return {l.positions,
          query,
          static_cast<T*>(l.key),
          cos_sin,
          l.num_tokens,
          static_cast<int>(l.num_heads),
          static_cast<int>(l.num_kv_heads),
          static_cast<int>(l.rot_dim / 2),
          l.query_token_stride,
          l.query_head_stride,
          l.key_token_stride,
          l.key_head_stride,
          l.cache_stride};
}

// Calls f(T* query, const CosSinT* cos_sin_cache) for query's dtype and a cos/sin table in that
// dtype or float32.
template <typename F>
cudaError_t dispatch_rope_types(DType dtype, DType cache_dtype, void* query,
                                const void* cos_sin_cache, const char* op, F&& f) {
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    T* q = static_cast<T*>(query);
    if (cache_dtype == DType::kFloat32) return f(q, static_cast<const float*>(cos_sin_cache));
    if (cache_dtype == dtype) return f(q, static_cast<const T*>(cos_sin_cache));
    PYORCH_INVALID("%s: cos_sin_cache must be %s or float32, got %s", op, dtype_name(dtype),
                   dtype_name(cache_dtype));
  });
}

}  // namespace

cudaError_t rotary_embedding(const int64_t* positions, void* query, void* key,
                             const void* cos_sin_cache, DType dtype, DType cache_dtype,
                             int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_size, int64_t rot_dim, int64_t query_token_stride,
                             int64_t query_head_stride, int64_t key_token_stride,
                             int64_t key_head_stride, int64_t cache_stride, bool is_neox,
                             cudaStream_t stream) {
  if (key == nullptr) num_kv_heads = 0;
  PYORCH_RETURN_IF_ERROR(check_rope_sizes(num_heads, num_kv_heads, head_size, rot_dim));
  const RopeLayout layout{positions,          key,
                          num_tokens,         num_heads,
                          num_kv_heads,       rot_dim,
                          query_token_stride, query_head_stride,
                          key_token_stride,   key_head_stride,
                          cache_stride};
  return dispatch_rope_types(
      dtype, cache_dtype, query, cos_sin_cache, "rotary_embedding", [&](auto* q, auto* cos_sin) {
        return kernels::launch_rotary_embedding(rope_params(layout, q, cos_sin), is_neox, stream);
      });
}

cudaError_t rotary_embedding_and_cache(
    const int64_t* positions, void* query, void* key, const void* value, const void* cos_sin_cache,
    DType dtype, DType cache_dtype, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_size, int64_t rot_dim, int64_t query_token_stride, int64_t query_head_stride,
    int64_t key_token_stride, int64_t key_head_stride, int64_t value_token_stride,
    int64_t value_head_stride, int64_t cache_stride, bool is_neox, void* key_cache,
    void* value_cache, const int64_t* slot_mapping, const float* k_scale, const float* v_scale,
    KVCacheDType kv_cache_dtype, int64_t num_blocks, int64_t block_size, int64_t kv_block_stride,
    int64_t kv_slot_stride, int64_t kv_head_stride, const void* q_norm_weight,
    const void* k_norm_weight, float norm_eps, cudaStream_t stream) {
  PYORCH_RETURN_IF_ERROR(check_rope_sizes(num_heads, num_kv_heads, head_size, rot_dim));
  if ((q_norm_weight == nullptr) != (k_norm_weight == nullptr)) {
    PYORCH_INVALID("rotary_embedding_and_cache: q_norm_weight and k_norm_weight go together");
  }
  if (num_tokens == 0) return cudaSuccess;  // empty tensors may have null data pointers
  if (key == nullptr || value == nullptr || key_cache == nullptr || value_cache == nullptr) {
    PYORCH_INVALID("rotary_embedding_and_cache: key, value and both caches are required");
  }
  const RopeLayout layout{positions,          key,
                          num_tokens,         num_heads,
                          num_kv_heads,       rot_dim,
                          query_token_stride, query_head_stride,
                          key_token_stride,   key_head_stride,
                          cache_stride};
  auto run = [&](auto* q, auto* cos_sin, auto* kv_cache, auto fp8) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(q)>;
    using KvT = std::remove_pointer_t<decltype(kv_cache)>;
    const kernels::RopeKvParams<T, KvT> kv{static_cast<const T*>(value),
                                           kv_cache,
                                           static_cast<KvT*>(value_cache),
                                           slot_mapping,
                                           k_scale,
                                           v_scale,
                                           value_token_stride,
                                           value_head_stride,
                                           num_blocks * block_size,
                                           block_size,
                                           kv_block_stride,
                                           kv_slot_stride,
                                           kv_head_stride,
                                           static_cast<int>(head_size),
                                           static_cast<const T*>(q_norm_weight),
                                           static_cast<const T*>(k_norm_weight),
                                           norm_eps};
    return kernels::launch_rotary_embedding_and_cache<
        T, std::remove_const_t<std::remove_pointer_t<decltype(cos_sin)>>, KvT,
        decltype(fp8)::value>(rope_params(layout, q, cos_sin), kv, is_neox, stream);
  };
  return dispatch_rope_types(
      dtype, cache_dtype, query, cos_sin_cache, "rotary_embedding_and_cache",
      [&](auto* q, auto* cos_sin) -> cudaError_t {
        using T = std::remove_pointer_t<decltype(q)>;
        switch (kv_cache_dtype) {
          case KVCacheDType::kAuto:
            return run(q, cos_sin, static_cast<T*>(key_cache), std::false_type{});
          case KVCacheDType::kFp8E4M3:
            return run(q, cos_sin, static_cast<uint8_t*>(key_cache), std::true_type{});
        }
        PYORCH_INVALID("rotary_embedding_and_cache: unsupported kv_cache_dtype %d",
                       static_cast<int>(kv_cache_dtype));
      });
}

}  // namespace pyorch
