// pyorch's default attention over the NHD paged KV cache, and the log-sum-exp merge of two partial
// attentions. Torch-free: raw pointers, element strides and a stream in, cudaError_t out.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// One call of paged_attention: a mixed batch of prefills, chunked prefills and decodes.
// Sequence i owns query rows [query_start_loc[i], query_start_loc[i+1]); they are its LAST q_len_i
// positions, so query t (0-based) sits at position seq_lens[i] - q_len_i + t. Strides are in
// elements; the last dimension of every tensor is contiguous.
struct PagedAttentionParams {
  void* out;                       // [num_tokens, num_heads, head_size] (out_token/head_stride)
  const void* query;               // [num_tokens, num_heads, head_size] (q_token/head_stride)
  const void* key_cache;           // [num_blocks, block_size, num_kv_heads, head_size]
  const void* value_cache;         // [num_blocks, block_size, num_kv_heads, head_size]
  const int32_t* query_start_loc;  // [num_seqs + 1], device
  const int32_t* seq_lens;         // [num_seqs], device: cached + new tokens
  const int32_t* block_table;      // [num_seqs, block_table_stride], device
  const float* k_scale;            // [1], device; fp8 caches only (nullptr: 1.0)
  const float* v_scale;            // [1], device; fp8 caches only (nullptr: 1.0)
  DType dtype;                     // of query and out: kFloat16 or kBFloat16
  KVCacheDType kv_cache_dtype;     // kAuto (caches in dtype) or kFp8E4M3 (bytes, value * scale)
  int64_t num_tokens;  // rows of query/out; rows past query_start_loc[num_seqs] untouched
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;        // divides num_heads
  int64_t head_size;           // paged_attention_supports_head_size(): vLLM's nine sizes
  int64_t block_size;          // tokens per cache block, any value >= 1
  int64_t max_blocks_per_seq;  // valid columns of block_table
  int64_t block_table_stride;
  int64_t q_token_stride, q_head_stride;
  int64_t out_token_stride, out_head_stride;
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int64_t v_block_stride, v_token_stride, v_head_stride;
  int64_t max_query_len;   // host hints, upper bounds: pick the KV split, and a call
  int64_t max_seq_len;     // with max_query_len * G <= 16 runs only the decode kernel
  float scale;             // softmax scale applied to q.k
  bool causal;             // false: every query sees all seq_len keys
  int32_t sliding_window;  // > 0: only keys with position > pos - sliding_window
  float logits_soft_cap;   // > 0: s = cap * tanh(s / cap) on the scaled scores
  // Optional (nullptr: not written): [num_heads, num_tokens] float32 with row stride
  // lse_head_stride, the natural-log log-sum-exp of each query row's scaled (and capped) scores;
  // -inf for a row that sees no key. With it, two calls over disjoint key ranges of the same
  // queries combine exactly through merge_attn_states (cascade attention over a shared prefix).
  float* lse;
  int64_t lse_head_stride;
};

// The head sizes paged_attention runs: 32, 64, 80, 96, 112, 120, 128, 192 and 256 (vLLM's
// attention's list). The list itself is written once, in cuda/attention/attention.cu; any other
// size makes paged_attention return cudaErrorInvalidValue ("Unsupported head size: N").
bool paged_attention_supports_head_size(int64_t head_size);

// Bytes per copy with which the kernels load a query or cache row of `row_bytes` bytes (a multiple
// of 8 for every supported head size): 16, or 8 where a row is no whole number of 16-byte chunks
// (an fp8 cache at head size 120). The row's base pointer and strides must be multiples of it.
constexpr int64_t paged_attention_copy_bytes(int64_t row_bytes) {
  return row_bytes % 16 == 0 ? 16 : 8;
}

// Bytes of scratch that paged_attention needs for these params on the current device: the split
// partials when it splits the KV range, and a few bytes of work-item counters whenever a sequence
// takes the prefill kernel (0 for a pure decode batch that does not split). Depends only on the
// host-side fields, so callers can allocate it from a caching allocator, also inside CUDA-graph
// capture; the call zeroes what it needs (no initialization by the caller).
size_t paged_attention_workspace_size(const PagedAttentionParams& params);

// Runs the attention on `stream` without synchronizing; reads k_scale/v_scale on the device, so it
// can be captured in a CUDA graph. workspace: at least paged_attention_workspace_size() bytes,
// 16-byte aligned (may be nullptr when that size is 0).
cudaError_t paged_attention(const PagedAttentionParams& params, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream);

// fp8-cache decode: its K/V copies ask L2 to fetch 256 bytes around each row (cp.async
// .L2::256B), so that one DRAM access serves the rows of neighbouring kv heads, which the CTAs
// launched beside this one read at about the same time (an fp8 row of head 128 is 128 bytes).
// On by default; a process-wide switch for A/B timing (bench_paged_attention --fp8-l2-prefetch).
// Set it before any graph is captured. Safe to call from any thread.
void set_decode_fp8_l2_prefetch(bool enabled);

// Decode kernel shape, for A/B timing (bench_paged_attention --decode-ctas-per-sm): 0 (default)
// the launcher's rule; 1, 2 or 3 forces the whole-SM (fp16/bf16 caches only; fp8 takes 2), the
// 2-CTA or the 3-CTA shape (where three fit the SM; else 2). Returns false (and changes nothing)
// for any other value. Set it before any graph is captured. Safe to call from any thread.
bool set_decode_ctas_per_sm(int ctas_per_sm);

// output = (e^{lp-m} * prefix_output + e^{ls-m} * suffix_output) / (e^{lp-m} + e^{ls-m}),
// m = max(lp, ls), per (token, head). output/prefix_output/suffix_output:
// [num_tokens, num_heads, head_size] in dtype (fp32, fp16 or bf16; strides in elements, last dim
// contiguous); prefix_lse/suffix_lse/output_lse: [num_heads, num_tokens] float32 with row stride
// lse_head_stride (natural log). output_lse may be nullptr. An lse of +inf is read as -inf (an
// empty part, as FlashAttention-2 reports it); when both are -inf the output is zeros and
// output_lse is -inf.
cudaError_t merge_attn_states(void* output, float* output_lse, const void* prefix_output,
                              const float* prefix_lse, const void* suffix_output,
                              const float* suffix_lse, DType dtype, int64_t num_tokens,
                              int64_t num_heads, int64_t head_size, int64_t out_token_stride,
                              int64_t out_head_stride, int64_t prefix_token_stride,
                              int64_t prefix_head_stride, int64_t suffix_token_stride,
                              int64_t suffix_head_stride, int64_t lse_head_stride,
                              cudaStream_t stream);

// Cascade attention's merge, in place: for i < num_rows, out[rows[i]] (that row's attention over
// its own suffix, log-sum-exps suffix_lse [num_heads, suffix_lse_head_stride]) becomes its merge
// with prefix_output[i] (the row's group prefix, prefix_lse [num_heads, prefix_lse_head_stride]).
// out/prefix_output: [*, num_heads, head_size] in dtype (fp32, fp16 or bf16), last dim contiguous.
// rows: int64 on the device; a row outside [0, num_tokens) is skipped.
cudaError_t merge_prefix_into_rows(void* out, const float* suffix_lse,
                                   int64_t suffix_lse_head_stride, const void* prefix_output,
                                   const float* prefix_lse, int64_t prefix_lse_head_stride,
                                   const int64_t* rows, int64_t num_rows, int64_t num_tokens,
                                   DType dtype, int64_t num_heads, int64_t head_size,
                                   int64_t out_token_stride, int64_t out_head_stride,
                                   int64_t prefix_token_stride, int64_t prefix_head_stride,
                                   cudaStream_t stream);

}  // namespace pyorch
