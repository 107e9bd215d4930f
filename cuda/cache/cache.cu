// Instantiates the KV-cache kernels behind the torch-free C API (a dtype x kv_cache_dtype switch),
// and the host side of copy_blocks (copy-unit choice, layer chunks) and swap_blocks (memcpys).
#include <cstdint>
#include <type_traits>

#include "cache/cache_kernels.cuh"
#include "pyorch/cache.h"

namespace pyorch {
namespace {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>, TypeTag<CacheT>, std::bool_constant<FP8>) for the runtime element type of
// key/value and the cache's storage: T itself (auto) or fp8 e4m3 bytes.
template <typename F>
cudaError_t dispatch_cache_types(DType dtype, KVCacheDType kv_cache_dtype, F&& f) {
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    switch (kv_cache_dtype) {
      case KVCacheDType::kAuto: return f(TypeTag<T>{}, TypeTag<T>{}, std::false_type{});
      case KVCacheDType::kFp8E4M3: return f(TypeTag<T>{}, TypeTag<uint8_t>{}, std::true_type{});
    }
    PYORCH_INVALID("unsupported kv_cache_dtype %d", static_cast<int>(kv_cache_dtype));
  });
}

// The widest copy unit (16, 8, 4, 2 or 1 bytes) that every address and size is a multiple of.
int copy_unit_bytes(void* const* key_caches, void* const* value_caches, int64_t num_layers,
                    int64_t block_bytes, int64_t block_stride_bytes) {
  uint64_t bits = static_cast<uint64_t>(block_bytes) | static_cast<uint64_t>(block_stride_bytes);
  for (int64_t l = 0; l < num_layers; ++l) {
    bits |=
        reinterpret_cast<uintptr_t>(key_caches[l]) | reinterpret_cast<uintptr_t>(value_caches[l]);
  }
  for (int unit = 16; unit > 1; unit /= 2) {
    if (bits % unit == 0) return unit;
  }
  return 1;
}

template <typename U>
cudaError_t launch_copy_blocks(void* const* key_caches, void* const* value_caches,
                               int64_t num_layers, const int64_t* block_mapping, int64_t num_pairs,
                               int64_t num_blocks, int64_t block_bytes, int64_t block_stride_bytes,
                               cudaStream_t stream) {
  const int64_t units_per_block = block_bytes / static_cast<int64_t>(sizeof(U));
  const int64_t block_stride_units = block_stride_bytes / static_cast<int64_t>(sizeof(U));
  // One launch per kMaxCopyLayers layers: the pointers travel as kernel parameters, so nothing
  // has to be allocated or copied to the device first.
  for (int64_t first = 0; first < num_layers; first += kernels::kMaxCopyLayers) {
    const int64_t n = std::min<int64_t>(kernels::kMaxCopyLayers, num_layers - first);
    kernels::CopyBlocksLayers layers{};
    for (int64_t l = 0; l < n; ++l) {
      layers.key[l] = static_cast<char*>(key_caches[first + l]);
      layers.value[l] = static_cast<char*>(value_caches[first + l]);
    }
    const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(n), 2);
    kernels::copy_blocks_kernel<U><<<grid, kernels::kCacheThreads, 0, stream>>>(
        layers, block_mapping, num_blocks, units_per_block, block_stride_units);
    PYORCH_RETURN_IF_ERROR(cudaGetLastError());
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t reshape_and_cache_flash(
    const void* key, const void* value, void* key_cache, void* value_cache,
    const int64_t* slot_mapping, const float* k_scale, const float* v_scale, DType dtype,
    KVCacheDType kv_cache_dtype, int64_t num_tokens, int64_t num_kv_heads, int64_t head_size,
    int64_t num_blocks, int64_t block_size, int64_t key_token_stride, int64_t key_head_stride,
    int64_t value_token_stride, int64_t value_head_stride, int64_t cache_block_stride,
    int64_t cache_slot_stride, int64_t cache_head_stride, cudaStream_t stream) {
  return dispatch_cache_types(dtype, kv_cache_dtype, [&](auto t_tag, auto c_tag, auto fp8) {
    using T = typename decltype(t_tag)::type;
    using CacheT = typename decltype(c_tag)::type;
    return kernels::launch_reshape_and_cache_flash<T, CacheT, decltype(fp8)::value>(
        static_cast<const T*>(key), static_cast<const T*>(value), static_cast<CacheT*>(key_cache),
        static_cast<CacheT*>(value_cache), slot_mapping, k_scale, v_scale, num_tokens, num_kv_heads,
        head_size, num_blocks, block_size, key_token_stride, key_head_stride, value_token_stride,
        value_head_stride, cache_block_stride, cache_slot_stride, cache_head_stride, stream);
  });
}

cudaError_t reshape_and_cache(const void* key, const void* value, void* key_cache,
                              void* value_cache, const int64_t* slot_mapping, const float* k_scale,
                              const float* v_scale, DType dtype, KVCacheDType kv_cache_dtype,
                              int64_t num_tokens, int64_t num_kv_heads, int64_t head_size,
                              int64_t num_blocks, int64_t block_size, int64_t key_token_stride,
                              int64_t key_head_stride, int64_t value_token_stride,
                              int64_t value_head_stride, int64_t key_cache_block_stride,
                              int64_t key_cache_head_stride, int64_t value_cache_block_stride,
                              int64_t value_cache_head_stride, cudaStream_t stream) {
  return dispatch_cache_types(dtype, kv_cache_dtype, [&](auto t_tag, auto c_tag, auto fp8) {
    using T = typename decltype(t_tag)::type;
    using CacheT = typename decltype(c_tag)::type;
    return kernels::launch_reshape_and_cache<T, CacheT, decltype(fp8)::value>(
        static_cast<const T*>(key), static_cast<const T*>(value), static_cast<CacheT*>(key_cache),
        static_cast<CacheT*>(value_cache), slot_mapping, k_scale, v_scale, num_tokens, num_kv_heads,
        head_size, num_blocks, block_size, key_token_stride, key_head_stride, value_token_stride,
        value_head_stride, key_cache_block_stride, key_cache_head_stride, value_cache_block_stride,
        value_cache_head_stride, stream);
  });
}

cudaError_t copy_blocks(void* const* key_caches, void* const* value_caches, int64_t num_layers,
                        const int64_t* block_mapping, int64_t num_pairs, int64_t num_blocks,
                        int64_t block_bytes, int64_t block_stride_bytes, cudaStream_t stream) {
  if (num_layers == 0 || num_pairs == 0 || block_bytes == 0) return cudaSuccess;
  if (num_pairs > INT32_MAX) PYORCH_INVALID("copy_blocks: too many block pairs");
  const int unit =
      copy_unit_bytes(key_caches, value_caches, num_layers, block_bytes, block_stride_bytes);
  const auto launch = [&](auto unit_tag) {
    using U = typename decltype(unit_tag)::type;
    return launch_copy_blocks<U>(key_caches, value_caches, num_layers, block_mapping, num_pairs,
                                 num_blocks, block_bytes, block_stride_bytes, stream);
  };
  switch (unit) {
    case 16: return launch(TypeTag<uint4>{});
    case 8: return launch(TypeTag<uint2>{});
    case 4: return launch(TypeTag<uint32_t>{});
    case 2: return launch(TypeTag<uint16_t>{});
    default: return launch(TypeTag<uint8_t>{});
  }
}

cudaError_t swap_blocks(void* dst, const void* src, const int64_t* block_mapping, int64_t num_pairs,
                        int64_t block_bytes, int64_t src_block_stride_bytes,
                        int64_t dst_block_stride_bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  const bool contiguous =
      src_block_stride_bytes == block_bytes && dst_block_stride_bytes == block_bytes;
  int64_t i = 0;
  while (i < num_pairs) {
    const int64_t src_block = block_mapping[2 * i];
    const int64_t dst_block = block_mapping[2 * i + 1];
    // Runs of consecutive blocks on both sides (common after a sequential allocation) go as one
    // copy: per-call overhead, not bandwidth, bounds swaps of many small blocks.
    int64_t run = 1;
    if (contiguous) {
      while (i + run < num_pairs && block_mapping[2 * (i + run)] == src_block + run &&
             block_mapping[2 * (i + run) + 1] == dst_block + run) {
        ++run;
      }
    }
    PYORCH_RETURN_IF_ERROR(
        cudaMemcpyAsync(static_cast<char*>(dst) + dst_block * dst_block_stride_bytes,
                        static_cast<const char*>(src) + src_block * src_block_stride_bytes,
                        static_cast<size_t>(run * block_bytes), kind, stream));
    i += run;
  }
  return cudaSuccess;
}

}  // namespace pyorch
