// vLLM's decode-only paged attention (paged_attention_v1 / paged_attention_v2) on vLLM's split KV
// layout. One query token per sequence attends to its whole cached context.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"
#include "pyorch/paged_attention_v1_v2_sizes.h"

namespace pyorch {

// Arguments shared by v1 and v2. Strides are in elements. Within one (block, kv head) the caches
// are contiguous, and every tensor's last dimension is contiguous.
// NOTE(pav2): the struct's name is distinct from the NHD attention's on purpose: both live in
// namespace pyorch and are linked into one library.
struct PagedAttentionV1V2Args {
  void* out;                // [num_seqs, num_heads, head_size] (out_seq_stride, out_head_stride)
  const void* query;        // [num_seqs, num_heads, head_size] (q_seq_stride, q_head_stride)
  const void* key_cache;    // [num_blocks, num_kv_heads, head_size / x, block_size, x],
                            // x = 16 / element size (k_block_stride, k_head_stride)
  const void* value_cache;  // [num_blocks, num_kv_heads, head_size, block_size]
                            // (v_block_stride, v_head_stride)
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq] (row stride block_table_stride)
  const int32_t* seq_lens;      // [num_seqs]
  const float* alibi_slopes;    // [num_heads], or nullptr for no ALiBi
  const float* k_scale;         // [1] on the device; read only when kv_cache_dtype is fp8
  const float* v_scale;         // [1] on the device; read only when kv_cache_dtype is fp8
  DType dtype;                  // query/out (and cache, when kv_cache_dtype is auto) type
  KVCacheDType kv_cache_dtype;  // kAuto: caches hold dtype; kFp8E4M3: e4m3 bytes, value = fp8*scale
  int num_seqs;
  int num_heads;
  int num_kv_heads;  // divides num_heads (GQA)
  int head_size;     // one of kPagedAttentionV1V2HeadSizes
  int block_size;    // 8, 16 or 32
  int max_seq_len;   // bounds seq_lens; sizes the v2 grid
  float scale;       // softmax scale applied to q.k
  int64_t q_seq_stride, q_head_stride;
  int64_t out_seq_stride, out_head_stride;
  int64_t k_block_stride, k_head_stride;
  int64_t v_block_stride, v_head_stride;
  int64_t block_table_stride;
};

// One pass per (head, sequence): out = softmax(scale * q.K^T + alibi) V.
// Works for any context length (the kernel walks the context in 512-token chunks with an online
// softmax, so its shared memory does not grow with max_seq_len).
cudaError_t paged_attention_v1(const PagedAttentionV1V2Args& args, cudaStream_t stream);

// Split-K: one pass per (head, sequence, 512-token partition) into caller-provided scratch, then a
// reduce kernel combines the partitions into out.
// exp_sums, max_logits: [num_seqs, num_heads, max_num_partitions] float32, contiguous;
// tmp_out: [num_seqs, num_heads, max_num_partitions, head_size] of dtype, contiguous;
// max_num_partitions >= paged_attention_v2_num_partitions(max_seq_len).
cudaError_t paged_attention_v2(const PagedAttentionV1V2Args& args, float* exp_sums,
                               float* max_logits, void* tmp_out, int64_t max_num_partitions,
                               cudaStream_t stream);

}  // namespace pyorch
