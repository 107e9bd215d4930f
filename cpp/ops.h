// One prototype per registered op. CUDA adapters live in cpp/ops/ (global namespace, built only
// when torch has CUDA), CPU kernels in cpp/cpu/ (namespace pyorch::cpu). Both bind the same schema
// in torch_bindings.cpp; shapes are documented there and in the cuda/include headers.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#define PYORCH_DECLARE_OPS                                                                        \
  void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps);  \
  void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,      \
                          double eps);                                                            \
  void rotary_embedding(const at::Tensor& positions, at::Tensor& query,                           \
                        std::optional<at::Tensor> key, int64_t head_size,                         \
                        const at::Tensor& cos_sin_cache, bool is_neox);                           \
  void rotary_embedding_and_cache(                                                                \
      const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& value,   \
      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox, at::Tensor& key_cache,    \
      at::Tensor& value_cache, const at::Tensor& slot_mapping, const std::string& kv_cache_dtype, \
      const at::Tensor& k_scale, const at::Tensor& v_scale,                                       \
      const std::optional<at::Tensor>& q_norm_weight,                                             \
      const std::optional<at::Tensor>& k_norm_weight, double norm_eps);                           \
  void silu_and_mul(at::Tensor& out, const at::Tensor& input);                                    \
  void gelu_and_mul(at::Tensor& out, const at::Tensor& input);                                    \
  void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input);                               \
  void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,   \
                         at::Tensor& value_cache, const at::Tensor& slot_mapping,                 \
                         const std::string& kv_cache_dtype, const at::Tensor& k_scale,            \
                         const at::Tensor& v_scale);                                              \
  void reshape_and_cache_flash(const at::Tensor& key, const at::Tensor& value,                    \
                               at::Tensor& key_cache, at::Tensor& value_cache,                    \
                               const at::Tensor& slot_mapping, const std::string& kv_cache_dtype, \
                               const at::Tensor& k_scale, const at::Tensor& v_scale);             \
  void copy_blocks(const std::vector<at::Tensor>& key_caches,                                     \
                   const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping); \
  void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping);      \
  void paged_attention_v1(                                                                        \
      at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,                      \
      const at::Tensor& value_cache, int64_t num_kv_heads, double scale,                          \
      const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,             \
      int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,                         \
      const std::string& kv_cache_dtype, const at::Tensor& k_scale, const at::Tensor& v_scale,    \
      int64_t tp_rank, int64_t blocksparse_local_blocks, int64_t blocksparse_vert_stride,         \
      int64_t blocksparse_block_size, int64_t blocksparse_head_sliding_step);                     \
  void paged_attention_v2(                                                                        \
      at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits, at::Tensor& tmp_out,         \
      const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,        \
      int64_t num_kv_heads, double scale, const at::Tensor& block_tables,                         \
      const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,                        \
      const std::optional<at::Tensor>& alibi_slopes, const std::string& kv_cache_dtype,           \
      const at::Tensor& k_scale, const at::Tensor& v_scale, int64_t tp_rank,                      \
      int64_t blocksparse_local_blocks, int64_t blocksparse_vert_stride,                          \
      int64_t blocksparse_block_size, int64_t blocksparse_head_sliding_step);                     \
  void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,     \
                       const at::Tensor& value_cache, const at::Tensor& query_start_loc,          \
                       const at::Tensor& seq_lens, const at::Tensor& block_table,                 \
                       int64_t max_query_len, int64_t max_seq_len, double scale, bool causal,     \
                       int64_t sliding_window, double logits_soft_cap,                            \
                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,              \
                       const at::Tensor& v_scale, const std::optional<at::Tensor>& lse);          \
  void cascade_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,   \
                         const at::Tensor& value_cache, const at::Tensor& query_start_loc,        \
                         const at::Tensor& suffix_seq_lens, const at::Tensor& suffix_block_table, \
                         int64_t max_query_len, int64_t suffix_max_seq_len,                       \
                         const at::Tensor& perm, const at::Tensor& prefix_query_start_loc,        \
                         const at::Tensor& prefix_seq_lens, const at::Tensor& prefix_block_table, \
                         int64_t prefix_max_query_len, int64_t prefix_max_seq_len, double scale,  \
                         double logits_soft_cap, const std::string& kv_cache_dtype,               \
                         const at::Tensor& k_scale, const at::Tensor& v_scale);                   \
  void merge_attn_states(at::Tensor& output, std::optional<at::Tensor> output_lse,                \
                         const at::Tensor& prefix_output, const at::Tensor& prefix_lse,           \
                         const at::Tensor& suffix_output, const at::Tensor& suffix_lse);          \
  void skinny_gemm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,            \
                   const std::optional<at::Tensor>& bias);                                        \
  void skinny_gemm_fused(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,      \
                         const std::optional<at::Tensor>& bias,                                   \
                         const std::optional<at::Tensor>& norm_weight, double epsilon,            \
                         int64_t epilogue, std::optional<bool> pdl);                              \
  void apply_token_bitmask_inplace(at::Tensor& logits, const at::Tensor& bitmask,                 \
                                   const std::optional<at::Tensor>& indices);                     \
  void random_sample_from_logits(at::Tensor& out, const at::Tensor& logits,                       \
                                 const at::Tensor& temperature, const at::Tensor& seeds);

// Mixture of experts (cpp/cpu/moe.cpp, cpp/ops/moe.cpp).
#define PYORCH_DECLARE_MOE_OPS                                                                     \
  void topk_softmax(at::Tensor& topk_weights, at::Tensor& topk_indices,                            \
                    at::Tensor& token_expert_indices, const at::Tensor& gating_output,             \
                    bool renormalize);                                                             \
  void moe_sum(const at::Tensor& input, at::Tensor& output);                                       \
  void moe_align_block_size(const at::Tensor& topk_ids, int64_t num_experts, int64_t block_size,   \
                            at::Tensor& sorted_token_ids, at::Tensor& experts_ids,                 \
                            at::Tensor& num_tokens_post_pad,                                       \
                            const std::optional<at::Tensor>& expert_map);                          \
  void fused_moe_gemm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,          \
                      const std::optional<at::Tensor>& topk_weights,                               \
                      const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,            \
                      const at::Tensor& num_tokens_post_padded, int64_t top_k, int64_t block_size, \
                      bool silu_and_mul);

// MoE prefill path: permute, grouped GEMM, un-permute (cpp/cpu/moe_grouped.cpp,
// cpp/ops/moe_grouped.cpp).
#define PYORCH_DECLARE_MOE_GROUPED_OPS                                                             \
  void moe_grouped_permute(const at::Tensor& input, const at::Tensor& topk_ids,                    \
                           int64_t num_experts, const std::optional<at::Tensor>& expert_map,       \
                           at::Tensor& permuted, at::Tensor& expert_offsets,                       \
                           at::Tensor& inv_perm);                                                  \
  void moe_grouped_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight,            \
                        const at::Tensor& expert_offsets, const std::optional<at::Tensor>& alpha); \
  void moe_grouped_unpermute(const at::Tensor& permuted, const at::Tensor& inv_perm,               \
                             const std::optional<at::Tensor>& topk_weights, at::Tensor& output);

// W4A16: 4-bit weights x 16-bit activations (cpp/cpu/w4a16.cpp, cpp/ops/w4a16.cpp).
#define PYORCH_DECLARE_W4A16_OPS                                                               \
  at::Tensor gptq_marlin_repack(const at::Tensor& b_q_weight,                                  \
                                const std::optional<at::Tensor>& perm, int64_t size_k,         \
                                int64_t size_n, int64_t num_bits);                             \
  at::Tensor awq_marlin_repack(const at::Tensor& b_q_weight, int64_t size_k, int64_t size_n,   \
                               int64_t num_bits);                                              \
  at::Tensor gptq_marlin_gemm(const at::Tensor& a, const std::optional<at::Tensor>& c_or_none, \
                              const at::Tensor& b_q_weight, const at::Tensor& b_scales,        \
                              const std::optional<at::Tensor>& b_zeros_or_none,                \
                              const std::optional<at::Tensor>& perm_or_none,                   \
                              const at::Tensor& workspace, int64_t b_q_type, int64_t size_m,   \
                              int64_t size_n, int64_t size_k);

// GGUF (cpp/cpu/gguf.cpp, cpp/ops/gguf.cpp): vLLM's ggml ops; they return their result.
#define PYORCH_DECLARE_GGUF_OPS                                                                \
  at::Tensor ggml_dequantize(const at::Tensor& W, int64_t quant_type, int64_t m, int64_t n,    \
                             std::optional<at::ScalarType> dtype);                             \
  at::Tensor ggml_mul_mat_vec_a8(const at::Tensor& W, const at::Tensor& X, int64_t quant_type, \
                                 int64_t row);                                                 \
  at::Tensor ggml_mul_mat_a8(const at::Tensor& W, const at::Tensor& X, int64_t quant_type,     \
                             int64_t row);                                                     \
  void ggml_mul_mat_vec_fused(at::Tensor& out, const at::Tensor& X, const at::Tensor& W,       \
                              int64_t quant_type, int64_t row,                                 \
                              const std::optional<at::Tensor>& norm_weight, double eps,        \
                              const std::string& input_op, const std::string& epilogue);

// MoE decode kernel pair and grouped top-k router (cpp/cpu/moe_decode.cpp, cpp/ops/moe_decode.cpp).
#define PYORCH_DECLARE_MOE_DECODE_OPS                                                              \
  void fused_moe_decode(at::Tensor& out, at::Tensor& act, const at::Tensor& hidden_states,         \
                        const at::Tensor& w13, const at::Tensor& w2,                               \
                        const at::Tensor& topk_weights, const at::Tensor& sorted_token_ids,        \
                        const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,    \
                        int64_t block_size, std::optional<bool> pdl);                              \
  void grouped_topk(at::Tensor& topk_weights, at::Tensor& topk_ids,                                \
                    const at::Tensor& gating_output, int64_t num_expert_group, int64_t topk_group, \
                    bool renormalize, const std::string& scoring_func,                             \
                    double routed_scaling_factor,                                                  \
                    const std::optional<at::Tensor>& e_score_correction_bias);

// CUDA adapters (cpp/ops/*.cpp).
PYORCH_DECLARE_OPS
PYORCH_DECLARE_MOE_OPS
PYORCH_DECLARE_MOE_GROUPED_OPS
PYORCH_DECLARE_W4A16_OPS
PYORCH_DECLARE_GGUF_OPS
PYORCH_DECLARE_MOE_DECODE_OPS

// CUDA-only: the custom all-reduce of tensor parallelism (cpp/ops/custom_all_reduce.cpp). The
// tensor ops are schemas; the IPC helpers map memory into the process (state, not tensor ops) and
// are bound with pybind11.
void custom_all_reduce(at::Tensor& out, const at::Tensor& input,
                       const std::vector<int64_t>& buffers, int64_t rank, int64_t max_bytes,
                       int64_t algo);
void custom_all_reduce_init_buffer(at::Tensor& buffer);
void custom_all_reduce_rms_norm(at::Tensor& out, const at::Tensor& input, at::Tensor& residual,
                                const at::Tensor& weight, double epsilon,
                                const std::vector<int64_t>& buffers, int64_t rank,
                                int64_t max_bytes);
namespace pyorch {
int64_t custom_all_reduce_buffer_size(int64_t max_bytes);
int64_t custom_all_reduce_push_bytes(int64_t max_bytes);
std::string ipc_handle_of(int64_t ptr);
int64_t ipc_open(const std::string& handle);
void ipc_close(int64_t ptr);
}  // namespace pyorch

// CPU kernels (cpp/cpu/*.cpp).
namespace pyorch::cpu {
PYORCH_DECLARE_OPS
PYORCH_DECLARE_MOE_OPS
PYORCH_DECLARE_MOE_GROUPED_OPS
PYORCH_DECLARE_W4A16_OPS
PYORCH_DECLARE_GGUF_OPS
PYORCH_DECLARE_MOE_DECODE_OPS
// The instruction set of the CPU GGUF products: sets it ("best", "avx512_vnni", "avx2",
// "portable") unless name is empty, and returns the one in use.
std::string gguf_cpu_isa(const std::string& name);
// ggml_mul_mat_a8 on Q4_0 / Q4_1 / Q8_0 blocks in the CPU's repacked layout (cpp/cpu/gguf.cpp).
at::Tensor ggml_mul_mat_repacked_a8(const at::Tensor& W, const at::Tensor& X, int64_t quant_type,
                                    int64_t row);
// out (=, += or silu-and-mul of) [norm(X)] @ W^T + bias with W repacked (fused_linear.py's CPU
// path).
void ggml_mul_mat_repacked_fused(at::Tensor& out, const at::Tensor& X, const at::Tensor& W,
                                 int64_t quant_type, int64_t row,
                                 const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& norm_weight, double eps,
                                 const std::string& epilogue);
}  // namespace pyorch::cpu
