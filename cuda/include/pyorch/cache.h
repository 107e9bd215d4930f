// KV-cache writes and block copies: the torch-free C API behind the cache ops.
//
// A KV page is a block of block_size token slots; slot = block_id * block_size + offset, and a
// negative slot marks a padding token that is skipped. Strides are in elements, the innermost
// dimension of every tensor is contiguous. With kv_cache_dtype kFp8E4M3 the caches hold fp8 e4m3
// bytes, stored = fp8(clamp(x / scale, -448, 448)), with the scales read on the device (k_scale,
// v_scale point at one float each) so that the writes can be captured in a CUDA graph.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// Writes new keys and values into caches in the NHD layout (FlashAttention / FlashInfer).
// key: [num_tokens, num_kv_heads, head_size] (strides key_token_stride, key_head_stride, 1),
// value: same shape (value_token_stride, value_head_stride, 1), slot_mapping: [num_tokens] int64,
// key_cache / value_cache: [num_blocks, block_size, num_kv_heads, head_size], both with the strides
// (cache_block_stride, cache_slot_stride, cache_head_stride, 1). dtype is the type of key/value;
// the caches hold dtype (kAuto) or fp8 bytes (kFp8E4M3). Slots past the end of the cache are
// skipped (the adapters reject them first where they can see them without a device sync).
cudaError_t reshape_and_cache_flash(
    const void* key, const void* value, void* key_cache, void* value_cache,
    const int64_t* slot_mapping, const float* k_scale, const float* v_scale, DType dtype,
    KVCacheDType kv_cache_dtype, int64_t num_tokens, int64_t num_kv_heads, int64_t head_size,
    int64_t num_blocks, int64_t block_size, int64_t key_token_stride, int64_t key_head_stride,
    int64_t value_token_stride, int64_t value_head_stride, int64_t cache_block_stride,
    int64_t cache_slot_stride, int64_t cache_head_stride, cudaStream_t stream);

// Same write into vLLM's split layout, with x = 16 / (cache element size):
// key_cache: [num_blocks, num_kv_heads, head_size / x, block_size, x] (strides
// key_cache_block_stride, key_cache_head_stride, block_size * x, x, 1), value_cache: [num_blocks,
// num_kv_heads, head_size, block_size] (strides value_cache_block_stride, value_cache_head_stride,
// block_size, 1). head_size must be a multiple of x.
cudaError_t reshape_and_cache(const void* key, const void* value, void* key_cache,
                              void* value_cache, const int64_t* slot_mapping, const float* k_scale,
                              const float* v_scale, DType dtype, KVCacheDType kv_cache_dtype,
                              int64_t num_tokens, int64_t num_kv_heads, int64_t head_size,
                              int64_t num_blocks, int64_t block_size, int64_t key_token_stride,
                              int64_t key_head_stride, int64_t value_token_stride,
                              int64_t value_head_stride, int64_t key_cache_block_stride,
                              int64_t key_cache_head_stride, int64_t value_cache_block_stride,
                              int64_t value_cache_head_stride, cudaStream_t stream);

// For every layer, copies block src -> dst in its key and its value cache, in one launch for up to
// 128 layers. key_caches / value_caches: HOST arrays [num_layers] of device pointers; each cache is
// [num_blocks, ...] whose blocks are block_bytes contiguous bytes, block_stride_bytes apart.
// block_mapping: DEVICE [num_pairs, 2] int64 (src, dst); a pair with an id outside [0, num_blocks)
// is skipped. A dst block must not be the src of another pair (the pairs run in parallel).
cudaError_t copy_blocks(void* const* key_caches, void* const* value_caches, int64_t num_layers,
                        const int64_t* block_mapping, int64_t num_pairs, int64_t num_blocks,
                        int64_t block_bytes, int64_t block_stride_bytes, cudaStream_t stream);

// Copies block src -> dst from one cache to another, possibly across host and device memory, with
// one cudaMemcpyAsync per run of consecutive blocks, on `stream`. src / dst: [num_*_blocks, ...]
// whose blocks are block_bytes contiguous bytes (src_block_stride_bytes / dst_block_stride_bytes
// apart). block_mapping: HOST [num_pairs, 2] int64 (src, dst), already checked to be in range.
// kind: the direction (cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice).
cudaError_t swap_blocks(void* dst, const void* src, const int64_t* block_mapping, int64_t num_pairs,
                        int64_t block_bytes, int64_t src_block_stride_bytes,
                        int64_t dst_block_stride_bytes, cudaMemcpyKind kind, cudaStream_t stream);

}  // namespace pyorch
