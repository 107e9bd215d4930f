// Argument checks for the KV-cache ops, shared by the CUDA adapters (cpp/ops/cache.cpp) and the CPU
// kernels (cpp/cpu/cache.cpp) so that both backends reject the same inputs with the same messages.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "common.h"

namespace pyorch {

enum class CacheLayout {
  kFlash,  // NHD: [num_blocks, block_size, num_kv_heads, head_size]
  kSplit,  // vLLM: key [num_blocks, num_kv_heads, head_size / x, block_size, x],
           //       value [num_blocks, num_kv_heads, head_size, block_size]
};

// The sizes of a reshape_and_cache(_flash) call, once its arguments have been checked.
struct CacheWriteShape {
  int64_t num_tokens;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t num_blocks;
  int64_t block_size;
  KVCacheDType kv_cache_dtype;
};

// A dimension of size <= 1 may have any stride.
inline bool has_stride(const at::Tensor& t, int64_t dim, int64_t stride) {
  return t.size(dim) <= 1 || t.stride(dim) == stride;
}

inline void check_same_device(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                              const char* b_name, const char* op) {
  TORCH_CHECK(a.device() == b.device(), op, ": all tensors must be on one device, but ", a_name,
              " is on ", a.device(), " and ", b_name, " on ", b.device());
}

inline void check_scale(const at::Tensor& scale, const at::Tensor& key, const char* name,
                        const char* op) {
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kFloat, op, ": ", name,
              " must be a one-element float32 tensor, got ", scale.scalar_type(), " of shape ",
              scale.sizes());
  check_same_device(scale, name, key, "key", op);
}

inline void check_flash_caches(const at::Tensor& key_cache, const at::Tensor& value_cache,
                               int64_t num_kv_heads, int64_t head_size, const char* op) {
  TORCH_CHECK(
      key_cache.dim() == 4 && key_cache.size(2) == num_kv_heads && key_cache.size(3) == head_size,
      op, ": key_cache must be [num_blocks, block_size, num_kv_heads=", num_kv_heads,
      ", head_size=", head_size, "], got ", key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), op, ": value_cache shape ",
              value_cache.sizes(), " != key_cache shape ", key_cache.sizes());
  TORCH_CHECK(has_stride(key_cache, 3, 1), op,
              ": the head_size dim of the caches must be contiguous");
  TORCH_CHECK(value_cache.strides() == key_cache.strides(), op,
              ": key_cache and value_cache must have the same strides, got ", key_cache.strides(),
              " and ", value_cache.strides());
}

inline void check_split_caches(const at::Tensor& key_cache, const at::Tensor& value_cache,
                               int64_t num_kv_heads, int64_t head_size, const char* op) {
  const int64_t x = 16 / static_cast<int64_t>(key_cache.element_size());
  TORCH_CHECK(head_size % x == 0, op, ": head_size ", head_size, " is not divisible by x = 16 / ",
              key_cache.element_size(), "-byte cache element = ", x);
  TORCH_CHECK(
      key_cache.dim() == 5 && key_cache.size(4) == x, op,
      ": key_cache must be [num_blocks, num_kv_heads, head_size / x, block_size, x] with x = ", x,
      ", got ", key_cache.sizes());
  TORCH_CHECK(key_cache.size(1) == num_kv_heads && key_cache.size(2) == head_size / x, op,
              ": key_cache must be [num_blocks, num_kv_heads=", num_kv_heads,
              ", head_size/x=", head_size / x, ", block_size, x], got ", key_cache.sizes());
  const int64_t num_blocks = key_cache.size(0);
  const int64_t block_size = key_cache.size(3);
  TORCH_CHECK(value_cache.dim() == 4 && value_cache.size(0) == num_blocks &&
                  value_cache.size(1) == num_kv_heads && value_cache.size(2) == head_size &&
                  value_cache.size(3) == block_size,
              op, ": value_cache must be [num_blocks=", num_blocks, ", num_kv_heads=", num_kv_heads,
              ", head_size=", head_size, ", block_size=", block_size, "], got ",
              value_cache.sizes());
  TORCH_CHECK(has_stride(key_cache, 4, 1) && has_stride(key_cache, 3, x) &&
                  has_stride(key_cache, 2, block_size * x),
              op, ": each head of key_cache must be contiguous [head_size / x, block_size, x]");
  TORCH_CHECK(has_stride(value_cache, 3, 1) && has_stride(value_cache, 2, block_size), op,
              ": each head of value_cache must be contiguous [head_size, block_size]");
}

// Checks the arguments of reshape_and_cache (kSplit) or reshape_and_cache_flash (kFlash).
inline CacheWriteShape check_cache_write(const at::Tensor& key, const at::Tensor& value,
                                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                                         const at::Tensor& slot_mapping,
                                         const std::string& kv_cache_dtype,
                                         const at::Tensor& k_scale, const at::Tensor& v_scale,
                                         CacheLayout layout, const char* op) {
  const KVCacheDType kv = parse_kv_cache_dtype(kv_cache_dtype);
  TORCH_CHECK(key.dim() == 3, op, ": key must be [num_tokens, num_kv_heads, head_size], got ",
              key.sizes());
  TORCH_CHECK(value.sizes() == key.sizes(), op, ": value shape ", value.sizes(), " != key shape ",
              key.sizes());
  const at::ScalarType dtype = key.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": key must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(value.scalar_type() == dtype, op, ": value dtype ", value.scalar_type(),
              " != key dtype ", dtype);
  TORCH_CHECK(has_stride(key, 2, 1) && has_stride(value, 2, 1), op,
              ": the head_size dim of key and value must be contiguous");
  const int64_t num_tokens = key.size(0);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens, op,
              ": slot_mapping must be [num_tokens=", num_tokens, "], got ", slot_mapping.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, op, ": slot_mapping must be int64, got ",
              slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.is_contiguous(), op, ": slot_mapping must be contiguous");
  check_kv_cache_dtype(key_cache, kv, dtype, op);
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), op, ": value_cache dtype ",
              value_cache.scalar_type(), " != key_cache dtype ", key_cache.scalar_type());
  check_same_device(value, "value", key, "key", op);
  check_same_device(key_cache, "key_cache", key, "key", op);
  check_same_device(value_cache, "value_cache", key, "key", op);
  check_same_device(slot_mapping, "slot_mapping", key, "key", op);
  if (kv == KVCacheDType::kFp8E4M3) {
    check_scale(k_scale, key, "k_scale", op);
    check_scale(v_scale, key, "v_scale", op);
  }
  const int64_t num_kv_heads = key.size(1);
  const int64_t head_size = key.size(2);
  if (layout == CacheLayout::kFlash) {
    check_flash_caches(key_cache, value_cache, num_kv_heads, head_size, op);
    return {num_tokens, num_kv_heads, head_size, key_cache.size(0), key_cache.size(1), kv};
  }
  check_split_caches(key_cache, value_cache, num_kv_heads, head_size, op);
  return {num_tokens, num_kv_heads, head_size, key_cache.size(0), key_cache.size(3), kv};
}

// Bytes in one block of a cache whose dim 0 indexes blocks; each block must be contiguous.
inline int64_t block_bytes_of(const at::Tensor& cache, const char* name, const char* op) {
  TORCH_CHECK(cache.dim() >= 1, op, ": ", name, " must have a leading num_blocks dim");
  int64_t numel = 1;
  for (int64_t d = cache.dim() - 1; d >= 1; --d) {
    TORCH_CHECK(has_stride(cache, d, numel), op, ": each block of ", name,
                " must be contiguous, got strides ", cache.strides(), " for shape ", cache.sizes());
    numel *= cache.size(d);
  }
  TORCH_CHECK(cache.size(0) <= 1 || cache.stride(0) >= numel, op, ": the blocks of ", name,
              " overlap (stride ", cache.stride(0), " < block size ", numel, ")");
  return numel * static_cast<int64_t>(cache.element_size());
}

inline void check_block_mapping(const at::Tensor& block_mapping, const char* op) {
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2, op,
              ": block_mapping must be [num_pairs, 2], got ", block_mapping.sizes());
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong, op, ": block_mapping must be int64, got ",
              block_mapping.scalar_type());
}

// Every (src, dst) pair of a contiguous CPU block_mapping must name existing blocks.
inline void check_block_ids(const at::Tensor& host_mapping, int64_t num_src_blocks,
                            int64_t num_dst_blocks, const char* op) {
  const int64_t* ids = host_mapping.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < host_mapping.size(0); ++i) {
    TORCH_CHECK(ids[2 * i] >= 0 && ids[2 * i] < num_src_blocks, op, ": block_mapping[", i,
                "] has src block id ", ids[2 * i], " outside [0, ", num_src_blocks, ")");
    TORCH_CHECK(ids[2 * i + 1] >= 0 && ids[2 * i + 1] < num_dst_blocks, op, ": block_mapping[", i,
                "] has dst block id ", ids[2 * i + 1], " outside [0, ", num_dst_blocks, ")");
  }
}

// What copy_blocks needs once every layer's caches are checked against layer 0's.
struct CopyBlocksShape {
  int64_t num_layers;
  int64_t num_blocks;
  int64_t block_bytes;
  int64_t block_stride_bytes;
};

inline CopyBlocksShape check_copy_blocks(const std::vector<at::Tensor>& key_caches,
                                         const std::vector<at::Tensor>& value_caches,
                                         const at::Tensor& block_mapping, const char* op) {
  check_block_mapping(block_mapping, op);
  TORCH_CHECK(key_caches.size() == value_caches.size(), op, ": got ", key_caches.size(),
              " key caches but ", value_caches.size(), " value caches");
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  if (num_layers == 0) return {0, 0, 0, 0};
  // Key and value caches may differ in shape (the split layout), not in block geometry.
  const at::Tensor& k0 = key_caches[0];
  const at::Tensor& v0 = value_caches[0];
  const int64_t block_bytes = block_bytes_of(k0, "key_caches[0]", op);
  TORCH_CHECK(
      block_bytes_of(v0, "value_caches[0]", op) == block_bytes && v0.size(0) == k0.size(0) &&
          v0.element_size() == k0.element_size() && v0.stride(0) == k0.stride(0),
      op, ": value caches must have the key caches' num_blocks, block bytes and block stride");
  for (int64_t l = 0; l < num_layers; ++l) {
    for (const auto* pair : {&key_caches, &value_caches}) {
      const at::Tensor& c = (*pair)[l];
      const at::Tensor& ref = pair == &key_caches ? k0 : v0;
      TORCH_CHECK(c.sizes() == ref.sizes() && c.strides() == ref.strides() &&
                      c.scalar_type() == ref.scalar_type() && c.device() == k0.device(),
                  op, ": layer ", l, "'s ", pair == &key_caches ? "key" : "value",
                  " cache must match layer 0's shape ", ref.sizes(), ", strides, dtype and device");
    }
  }
  return {num_layers, k0.size(0), block_bytes,
          k0.stride(0) * static_cast<int64_t>(k0.element_size())};
}

// What swap_blocks needs: the mapping on the host, block bytes and block strides in bytes.
struct SwapBlocksShape {
  at::Tensor host_mapping;  // [num_pairs, 2] int64, contiguous, on the CPU
  int64_t block_bytes;
  int64_t src_block_stride_bytes;
  int64_t dst_block_stride_bytes;
};

inline SwapBlocksShape check_swap_blocks(const at::Tensor& src, const at::Tensor& dst,
                                         const at::Tensor& block_mapping, const char* op) {
  check_block_mapping(block_mapping, op);
  TORCH_CHECK(block_mapping.device().is_cpu(), op, ": block_mapping must be on the CPU, got ",
              block_mapping.device());
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), op, ": src dtype ", src.scalar_type(),
              " != dst dtype ", dst.scalar_type());
  TORCH_CHECK(
      src.dim() == dst.dim() && src.dim() >= 1 && src.sizes().slice(1) == dst.sizes().slice(1), op,
      ": src and dst must have the same block shape, got ", src.sizes(), " and ", dst.sizes());
  const int64_t block_bytes = block_bytes_of(src, "src", op);
  block_bytes_of(dst, "dst", op);
  at::Tensor host_mapping = block_mapping.contiguous();
  check_block_ids(host_mapping, src.size(0), dst.size(0), op);
  const auto elem = static_cast<int64_t>(src.element_size());
  return {host_mapping, block_bytes, src.stride(0) * elem, dst.stride(0) * elem};
}

}  // namespace pyorch
