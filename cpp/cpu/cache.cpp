// CPU KV-cache ops: token writes into the NHD and split layouts (optionally fp8 e4m3), block
// copies within caches and block swaps between them. Each task moves whole rows or blocks.
#include <algorithm>
#include <cstring>

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include "cache_checks.h"
#include "cpu/cpu_utils.h"
#include "ops.h"

namespace pyorch::cpu {
namespace {

constexpr float kFp8E4M3Max = 448.f;
// Aim for at least this many elements per parallel task.
constexpr int64_t kGrainElements = 16384;

// fp8(clamp(x / scale, -448, 448)), bit-identical to torch's
// (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn); NaN stays NaN as in torch's clamp.
template <typename T>
inline uint8_t to_fp8(T x, float scale) {
  float f = static_cast<float>(x) / scale;
  f = f > kFp8E4M3Max ? kFp8E4M3Max : (f < -kFp8E4M3Max ? -kFp8E4M3Max : f);
  return c10::Float8_e4m3fn(f).x;
}

// Writes n elements of src to dst[i * dst_stride]: as is (CacheT = T) or as fp8 bytes.
template <typename T, typename CacheT, bool FP8>
inline void write_elements(const T* src, CacheT* dst, int64_t n, int64_t dst_stride, float scale) {
  if constexpr (FP8) {
    for (int64_t i = 0; i < n; ++i) dst[i * dst_stride] = to_fp8(src[i], scale);
  } else if (dst_stride == 1) {
    std::memcpy(dst, src, n * sizeof(T));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i * dst_stride] = src[i];
  }
}

// Slots past the cache are an error here (the CUDA kernels can only drop them: no host sync).
void check_slots(const at::Tensor& slot_mapping, int64_t num_slots, const char* op) {
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < slot_mapping.numel(); ++t) {
    TORCH_CHECK(slots[t] < num_slots, op, ": slot_mapping[", t, "] = ", slots[t],
                " is past the cache's num_blocks * block_size = ", num_slots);
  }
}

// Strides of one layout, in elements of the cache.
struct CacheStrides {
  int64_t key_block, key_head, value_block, value_head;
  int64_t key_slot, value_slot;  // per slot within a block
  int64_t key_elem_chunk;        // split layout: elements per x-chunk run (x), else head_size
  int64_t key_chunk;             // split layout: stride between x-chunks (block_size * x)
  int64_t value_elem;            // stride between head_size elements of the value cache
};

template <typename T, typename CacheT, bool FP8>
void write_tokens(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                  at::Tensor& value_cache, const at::Tensor& slot_mapping, float k_scale,
                  float v_scale, const CacheWriteShape& s, const CacheStrides& cs) {
  const T* k = key.const_data_ptr<T>();
  const T* v = value.const_data_ptr<T>();
  CacheT* kc = static_cast<CacheT*>(key_cache.data_ptr());
  CacheT* vc = static_cast<CacheT*>(value_cache.data_ptr());
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t kts = key.stride(0), khs = key.stride(1);
  const int64_t vts = value.stride(0), vhs = value.stride(1);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (s.num_kv_heads * s.head_size + 1));
  at::parallel_for(0, s.num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding
      const int64_t block_id = slot / s.block_size;
      const int64_t offset = slot % s.block_size;
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        const T* ks = k + t * kts + h * khs;
        CacheT* kd = kc + block_id * cs.key_block + h * cs.key_head + offset * cs.key_slot;
        for (int64_t c = 0; c < s.head_size; c += cs.key_elem_chunk) {
          write_elements<T, CacheT, FP8>(ks + c, kd + (c / cs.key_elem_chunk) * cs.key_chunk,
                                         cs.key_elem_chunk, 1, k_scale);
        }
        write_elements<T, CacheT, FP8>(
            v + t * vts + h * vhs,
            vc + block_id * cs.value_block + h * cs.value_head + offset * cs.value_slot,
            s.head_size, cs.value_elem, v_scale);
      }
    }
  });
}

void write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                 at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                 const at::Tensor& v_scale, const CacheWriteShape& s, const CacheStrides& cs,
                 const char* op) {
  TORCH_CHECK(key.device().is_cpu(), op, ": tensors must be on the CPU");
  check_slots(slot_mapping, s.num_blocks * s.block_size, op);
  if (s.num_tokens == 0 || s.num_kv_heads == 0 || s.head_size == 0) return;
  const bool fp8 = s.kv_cache_dtype == KVCacheDType::kFp8E4M3;
  const float ks = fp8 ? scale_value(k_scale, op) : 1.f;
  const float vs = fp8 ? scale_value(v_scale, op) : 1.f;
  PYORCH_CPU_DISPATCH_FLOATS(key.scalar_type(), "reshape_and_cache", [&] {
    if (fp8) {
      write_tokens<scalar_t, uint8_t, true>(key, value, key_cache, value_cache, slot_mapping, ks,
                                            vs, s, cs);
    } else {
      write_tokens<scalar_t, scalar_t, false>(key, value, key_cache, value_cache, slot_mapping, ks,
                                              vs, s, cs);
    }
  });
}

}  // namespace

void reshape_and_cache_flash(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                             at::Tensor& value_cache, const at::Tensor& slot_mapping,
                             const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                             const at::Tensor& v_scale) {
  constexpr const char* kOp = "reshape_and_cache_flash";
  const CacheWriteShape s =
      check_cache_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                        v_scale, CacheLayout::kFlash, kOp);
  // A token's head row is head_size contiguous elements in both caches.
  const CacheStrides cs{key_cache.stride(0),
                        key_cache.stride(2),
                        value_cache.stride(0),
                        value_cache.stride(2),
                        key_cache.stride(1),
                        value_cache.stride(1),
                        std::max<int64_t>(s.head_size, 1),
                        0,
                        1};
  write_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, s, cs, kOp);
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                       const at::Tensor& v_scale) {
  constexpr const char* kOp = "reshape_and_cache";
  const CacheWriteShape s =
      check_cache_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                        v_scale, CacheLayout::kSplit, kOp);
  // Key: x-element chunks, block_size * x apart; value: single elements, block_size apart.
  const int64_t x = 16 / static_cast<int64_t>(key_cache.element_size());
  const CacheStrides cs{key_cache.stride(0),
                        key_cache.stride(1),
                        value_cache.stride(0),
                        value_cache.stride(1),
                        x,
                        1,
                        x,
                        s.block_size * x,
                        s.block_size};
  write_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, s, cs, kOp);
}

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  constexpr const char* kOp = "copy_blocks";
  const CopyBlocksShape s = check_copy_blocks(key_caches, value_caches, block_mapping, kOp);
  const at::Tensor mapping = block_mapping.to(at::kCPU).contiguous();
  if (s.num_layers == 0 || mapping.size(0) == 0) return;
  TORCH_CHECK(key_caches[0].device().is_cpu(), kOp, ": caches must be on the CPU");
  check_block_ids(mapping, s.num_blocks, s.num_blocks, kOp);
  const int64_t* ids = mapping.const_data_ptr<int64_t>();
  const int64_t num_pairs = mapping.size(0);
  // Tasks are (layer, pair); each copies the block in the key and in the value cache.
  const int64_t grain = std::max<int64_t>(1, kGrainElements * 4 / (s.block_bytes + 1));
  at::parallel_for(0, s.num_layers * num_pairs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t layer = task / num_pairs;
      const int64_t pair = task % num_pairs;
      for (const at::Tensor* cache : {&key_caches[layer], &value_caches[layer]}) {
        char* base = static_cast<char*>(cache->data_ptr());
        std::memmove(base + ids[2 * pair + 1] * s.block_stride_bytes,
                     base + ids[2 * pair] * s.block_stride_bytes, s.block_bytes);
      }
    }
  });
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  constexpr const char* kOp = "swap_blocks";
  TORCH_CHECK(src.device().is_cpu() && dst.device().is_cpu(), kOp,
              ": the CPU kernel copies between CPU tensors, got ", src.device(), " -> ",
              dst.device());
  const SwapBlocksShape s = check_swap_blocks(src, dst, block_mapping, kOp);
  const int64_t* ids = s.host_mapping.const_data_ptr<int64_t>();
  const char* src_base = static_cast<const char*>(src.const_data_ptr());
  char* dst_base = static_cast<char*>(dst.data_ptr());
  const int64_t grain = std::max<int64_t>(1, kGrainElements * 4 / (s.block_bytes + 1));
  at::parallel_for(0, s.host_mapping.size(0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memmove(dst_base + ids[2 * i + 1] * s.dst_block_stride_bytes,
                   src_base + ids[2 * i] * s.src_block_stride_bytes, s.block_bytes);
    }
  });
}

}  // namespace pyorch::cpu
