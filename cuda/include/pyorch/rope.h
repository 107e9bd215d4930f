// Rotary position embedding (vLLM's rotary_embedding), applied in place to query and key.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// Rotates the first rot_dim elements of every query and key head by the angle of its token's
// position; elements rot_dim..head_size-1 are left untouched (partial rotary). Math in fp32.
//   positions:     [num_tokens] int64, each in [0, max_position) (not checked on the device)
//   query:         [num_tokens, num_heads, head_size], element (t, h, i) at
//                  t * query_token_stride + h * query_head_stride + i
//   key:           [num_tokens, num_kv_heads, head_size] likewise, or nullptr (then num_kv_heads
//                  and the key strides are ignored)
//   cos_sin_cache: [max_position, rot_dim] (row stride cache_stride) = [cos | sin], each
//                  rot_dim / 2 wide; in `dtype` or float32 (cache_dtype)
// is_neox rotates the pairs (i, i + rot_dim / 2); otherwise (GPT-J) the pairs (2i, 2i + 1).
// rot_dim must be even and at most head_size. query and key share `dtype` (fp32, fp16, bf16).
cudaError_t rotary_embedding(const int64_t* positions, void* query, void* key,
                             const void* cos_sin_cache, DType dtype, DType cache_dtype,
                             int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_size, int64_t rot_dim, int64_t query_token_stride,
                             int64_t query_head_stride, int64_t key_token_stride,
                             int64_t key_head_stride, int64_t cache_stride, bool is_neox,
                             cudaStream_t stream);

// rotary_embedding on query and key, then key (rotated) and value written into NHD KV caches as
// reshape_and_cache_flash writes them (pyorch/cache.h), in one launch with the same bits.
//   key:           [num_tokens, num_kv_heads, head_size] (not nullptr), rotated in place too
//   value:         [num_tokens, num_kv_heads, head_size] (value_token_stride, value_head_stride)
//   key_cache / value_cache: [num_blocks, block_size, num_kv_heads, head_size], both with the
//                  strides (kv_block_stride, kv_slot_stride, kv_head_stride, 1), holding dtype
//                  (kAuto) or fp8 e4m3 bytes (kFp8E4M3, with k_scale / v_scale on the device)
//   slot_mapping:  [num_tokens] int64; a negative slot or one past the cache is not written
//   q_norm_weight / k_norm_weight: [head_size] in dtype, both or neither: each query / key head
//                  is first RMS-normalized (eps norm_eps) and scaled by its weight, as rms_norm
//                  over the heads would (Qwen3's q_norm / k_norm; vLLM's fused_qk_norm_rope).
//                  Needs rot_dim == head_size and head_size / 2 a power-of-two multiple (at most
//                  32) of the vector width (8 for 16-bit types and 16-byte aligned tensors).
cudaError_t rotary_embedding_and_cache(
    const int64_t* positions, void* query, void* key, const void* value, const void* cos_sin_cache,
    DType dtype, DType cache_dtype, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_size, int64_t rot_dim, int64_t query_token_stride, int64_t query_head_stride,
    int64_t key_token_stride, int64_t key_head_stride, int64_t value_token_stride,
    int64_t value_head_stride, int64_t cache_stride, bool is_neox, void* key_cache,
    void* value_cache, const int64_t* slot_mapping, const float* k_scale, const float* v_scale,
    KVCacheDType kv_cache_dtype, int64_t num_blocks, int64_t block_size, int64_t kv_block_stride,
    int64_t kv_slot_stride, int64_t kv_head_stride, const void* q_norm_weight,
    const void* k_norm_weight, float norm_eps, cudaStream_t stream);

}  // namespace pyorch
