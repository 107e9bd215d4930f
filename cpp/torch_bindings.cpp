// The one TORCH_LIBRARY(pyorch, m) block: every stateless op's schema, its CPU kernel and (when
// built with CUDA) its CUDA adapter. Stateful host objects (the block pool) are bound with pybind11
// in PYBIND11_MODULE below, which also serves as the extension's module init.
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "gemm_fp8_checks.h"  // skinny_gemm_fp8
#include "ops.h"
#include "pyorch/launch.h"
#include "quantization_ops.h"
#ifdef PYORCH_WITH_CUDA
#include "pyorch/custom_all_reduce.h"  // set_custom_all_reduce_rms_norm_split
#include "pyorch/gemm.h"               // set_skinny_gemm_legacy_picks
#include "pyorch/gguf.h"               // set_gguf_q4k_direct, set_gguf_fused_warps
#include "pyorch/moe_decode.h"         // set_moe_decode_legacy_picks
#include "pyorch/moe_grouped.h"
#include "pyorch/scaled_mm.h"  // cuda_runtime.h: CUDA builds only
#include "pyorch/w4a16.h"      // set_w4a16_prefetch_acts
#endif

namespace py = pybind11;

namespace pyorch::block {
void bind_block_manager(py::module_& m);  // cpp/block_manager/bindings.cpp
}  // namespace pyorch::block

TORCH_LIBRARY(pyorch, m) {
  // ---- norms ---------------------------------------------------------------------------------
  // out = input / sqrt(mean(input^2, -1) + eps) * weight. input/out: [..., hidden_size].
  m.def("rms_norm(Tensor! out, Tensor input, Tensor weight, float eps) -> ()");
  // residual += input; input = rms_norm(residual) * weight (both in place).
  m.def("fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, float eps) -> ()");

  // ---- rotary embedding ----------------------------------------------------------------------
  // positions: [num_tokens]; query: [num_tokens, num_heads * head_size] (or 3-D);
  // key: same with num_kv_heads or None; cos_sin_cache: [max_position, rot_dim] = [cos | sin].
  m.def(
      "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox) -> ()");
  // rotary_embedding on query and key, then reshape_and_cache_flash of the rotated key and value
  // (key and value: [num_tokens, num_kv_heads, head_size]), in one kernel on CUDA. With the norm
  // weights, every query and key head is first RMS-normalized (Qwen3's q_norm / k_norm).
  m.def(
      "rotary_embedding_and_cache(Tensor positions, Tensor! query, Tensor! key, Tensor value, "
      "int head_size, Tensor cos_sin_cache, bool is_neox, Tensor! key_cache, Tensor! value_cache, "
      "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale, "
      "Tensor? q_norm_weight=None, Tensor? k_norm_weight=None, float norm_eps=1e-6) -> ()");

  // ---- activations: out[..., d] = act(input[..., :d]) * input[..., d:] --------------------------
  m.def("silu_and_mul(Tensor! out, Tensor input) -> ()");
  m.def("gelu_and_mul(Tensor! out, Tensor input) -> ()");
  m.def("gelu_tanh_and_mul(Tensor! out, Tensor input) -> ()");

  // ---- KV cache ------------------------------------------------------------------------------
  // key/value: [num_tokens, num_kv_heads, head_size]; slot_mapping: [num_tokens] int64, < 0 skips.
  // vLLM's split layout: key_cache [num_blocks, num_kv_heads, head_size / x, block_size, x] with
  // x = 16 / element size, value_cache [num_blocks, num_kv_heads, head_size, block_size].
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, "
      "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()");
  // NHD layout: key_cache/value_cache [num_blocks, block_size, num_kv_heads, head_size].
  m.def(
      "reshape_and_cache_flash(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, "
      "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()");
  // block_mapping: [num_pairs, 2] int64 (src, dst) block ids, copied within each cache.
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor[](b!) value_caches, Tensor block_mapping) -> "
      "()");
  // src/dst: caches on different devices (or the same); block_mapping: [num_pairs, 2] int64 on CPU.
  m.def("swap_blocks(Tensor src, Tensor! dst, Tensor block_mapping) -> ()");

  // ---- attention -----------------------------------------------------------------------------
  // vLLM's decode-only paged attention on the split layout (see reshape_and_cache).
  m.def(
      "paged_attention_v1(Tensor! out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "int num_kv_heads, float scale, Tensor block_tables, Tensor seq_lens, int block_size, "
      "int max_seq_len, Tensor? alibi_slopes, str kv_cache_dtype, Tensor k_scale, "
      "Tensor v_scale, int tp_rank, int blocksparse_local_blocks, int blocksparse_vert_stride, "
      "int blocksparse_block_size, int blocksparse_head_sliding_step) -> ()");
  m.def(
      "paged_attention_v2(Tensor! out, Tensor! exp_sums, Tensor! max_logits, Tensor! tmp_out, "
      "Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, float scale, "
      "Tensor block_tables, Tensor seq_lens, int block_size, int max_seq_len, "
      "Tensor? alibi_slopes, str kv_cache_dtype, Tensor k_scale, Tensor v_scale, int tp_rank, "
      "int blocksparse_local_blocks, int blocksparse_vert_stride, int blocksparse_block_size, "
      "int blocksparse_head_sliding_step) -> ()");
  // pyorch's default attention on the NHD layout, for a mixed batch of prefills, chunked prefills
  // and decodes. query/out: [num_tokens, num_heads, head_size]; query_start_loc: [num_seqs + 1]
  // int32; seq_lens: [num_seqs] int32 (cached + new tokens, whose KV is already in the cache);
  // block_table: [num_seqs, max_blocks_per_seq] int32. The new tokens of sequence i are its last
  // query_start_loc[i+1] - query_start_loc[i] positions. sliding_window <= 0 and
  // logits_soft_cap <= 0 mean off.
  m.def(
      "paged_attention(Tensor! out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor block_table, int max_query_len, "
      "int max_seq_len, float scale, bool causal, int sliding_window, float logits_soft_cap, "
      "str kv_cache_dtype, Tensor k_scale, Tensor v_scale, Tensor!? lse=None) -> ()");
  // Decode attention over shared prefixes (cascade): every row's suffix (suffix_seq_lens /
  // suffix_block_table) into out, each group's prefix once for the rows perm lists group by group
  // (prefix_query_start_loc over perm), merged into out by log-sum-exp.
  m.def(
      "cascade_attention(Tensor! out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor query_start_loc, Tensor suffix_seq_lens, Tensor suffix_block_table, "
      "int max_query_len, int suffix_max_seq_len, Tensor perm, Tensor prefix_query_start_loc, "
      "Tensor prefix_seq_lens, Tensor prefix_block_table, int prefix_max_query_len, "
      "int prefix_max_seq_len, float scale, float logits_soft_cap, str kv_cache_dtype, "
      "Tensor k_scale, Tensor v_scale) -> ()");
  // Combines two partial attentions by log-sum-exp. outputs: [num_tokens, num_heads, head_size];
  // lse: [num_heads, num_tokens] float32.
  m.def(
      "merge_attn_states(Tensor! output, Tensor!? output_lse, Tensor prefix_output, "
      "Tensor prefix_lse, Tensor suffix_output, Tensor suffix_lse) -> ()");

  // ---- linear layers -------------------------------------------------------------------------
  // out = input @ weight^T (+ bias) for few rows (decode): input [num_tokens <= 16, input_size]
  // (input_size % 8 == 0, rows may be strided), weight [output_size, input_size] contiguous,
  // out [num_tokens, output_size], bias [output_size] or None; fp16/bf16, fp32 accumulation.
  m.def("skinny_gemm(Tensor! out, Tensor input, Tensor weight, Tensor? bias) -> ()");
  // skinny_gemm with the decoder layer's neighbours fused in (pyorch/_ops.py says how):
  // norm_weight [input_size] RMS-norms the input on the fly; epilogue 0 stores, 1 writes
  // silu(gate) * up of a [gate; up] weight (out [num_tokens, output_size / 2]), 2 adds into out.
  // pdl: launch with programmatic dependent launch (None: the default, off; CUDA only).
  m.def(
      "skinny_gemm_fused(Tensor! out, Tensor input, Tensor weight, Tensor? bias, "
      "Tensor? norm_weight, float epsilon, int epilogue, bool? pdl=None) -> ()");
  // skinny_gemm_fused with a float8_e4m3fn weight [output_size, input_size] (input_size % 16 ==
  // 0) and its float32 weight_scale ([1] or [output_size]), fp16/bf16 activations unquantized.
  m.def(
      "skinny_gemm_fp8(Tensor! out, Tensor input, Tensor weight, Tensor weight_scale, "
      "Tensor? bias, Tensor? norm_weight, float epsilon, int epilogue, bool? pdl=None) -> ()");

  // ---- custom all-reduce (tensor parallelism; CUDA only) ---------------------------------------
  // out = the sum over the ranks of each rank's input, identical on every rank. input, out: [n]
  // contiguous fp32/fp16/bf16, n * element size a multiple of 16 and <= max_bytes; buffers: the
  // address of every rank's IPC buffer in this process (own at [rank]), each of
  // pyorch._C.custom_all_reduce_buffer_size(max_bytes) bytes; algo 0 auto, 1 one-shot, 2 two-shot,
  // 3 one-shot push (at most pyorch._C.custom_all_reduce_push_bytes(max_bytes)).
  // Every rank calls it with the same sizes, in the same order (pyorch/distributed/).
  m.def(
      "custom_all_reduce(Tensor! out, Tensor input, int[] buffers, int rank, int max_bytes, "
      "int algo) -> ()");
  // Zeroes the signal area of a fresh buffer (uint8, on the rank's GPU), before the first call.
  m.def("custom_all_reduce_init_buffer(Tensor! buffer) -> ()");
  // Fused: residual += all-reduce(input); out = RMSNorm(residual) * weight. input, residual, out
  // [rows, hidden], weight [hidden]; rows * hidden * element size <= custom_all_reduce_push_bytes.
  m.def(
      "custom_all_reduce_rms_norm(Tensor! out, Tensor input, Tensor! residual, Tensor weight, "
      "float epsilon, int[] buffers, int rank, int max_bytes) -> ()");
  // ---- mixture of experts (M tokens, E experts, top_k per token, H hidden) ----------------------
  // Router: softmax of gating_output [M, E] in fp32, then the top_k largest (ties to the lower
  // expert id) into topk_weights [M, top_k] fp32 and topk_indices [M, top_k] int32/int64,
  // renormalized to sum to 1 when renormalize; token_expert_indices[m, j] = j * M + m.
  m.def(
      "topk_softmax(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, "
      "Tensor gating_output, bool renormalize) -> ()");
  // output [M, H] = sum over top_k of input [M, top_k, H] (fp32 sum, rounded once).
  m.def("moe_sum(Tensor input, Tensor! output) -> ()");
  // Sorts the M * top_k (token, expert) pairs of topk_ids [M, top_k] by expert, each expert's run
  // padded to a multiple of block_size: sorted_token_ids [>= M*top_k + min(E, M*top_k) *
  // (block_size - 1)] int32 holds flat pair ids (pad = M * top_k); experts_ids [one per block]
  // int32 the block's expert (mapped through expert_map [E] when given; -1 past the end);
  // num_tokens_post_pad [1] int32 the padded total.
  m.def(
      "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
      "Tensor! sorted_token_ids, Tensor! experts_ids, Tensor! num_tokens_post_pad, "
      "Tensor? maybe_expert_map=None) -> ()");
  // The grouped expert GEMM over moe_align_block_size's blocks: for each flat pair id f in a
  // block of expert e, c = input[f / top_k] @ weight[e]^T (weight [E, N, K]); out[f] = c, or
  // silu(c[:N/2]) * c[N/2:] when silu_and_mul; times topk_weights[f] when given. Blocks of
  // expert -1 write zeros. out: [M * top_k, N or N / 2].
  m.def(
      "fused_moe_gemm(Tensor! out, Tensor input, Tensor weight, Tensor? topk_weights, "
      "Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded, int top_k, "
      "int block_size, bool silu_and_mul) -> ()");

  // ---- MoE prefill path (cuda/include/pyorch/moe_grouped.h) ---------------------------------
  // Sorts the pairs of topk_ids [M, top_k] by local expert (through expert_map [num_experts]
  // int32 when given): expert_offsets [E_local + 1] int32, inv_perm [M, top_k] int32 (the pair's
  // row in permuted, -1 when its expert is not local) and permuted [M * top_k, H] (row inv_perm[f]
  // = input[f / top_k]).
  m.def(
      "moe_grouped_permute(Tensor input, Tensor topk_ids, int num_experts, Tensor? expert_map, "
      "Tensor! permuted, Tensor! expert_offsets, Tensor! inv_perm) -> ()");
  // out[r] = alpha[e] * a[r] @ weight[e]^T for rows r in [offsets[e], offsets[e + 1]) (alpha: fp8
  // only, [E] float32). CUDA: a CUTLASS ptr-array grouped GEMM (sm90a, bf16 or fp8 e4m3).
  m.def(
      "moe_grouped_gemm(Tensor! out, Tensor a, Tensor weight, Tensor expert_offsets, "
      "Tensor? alpha) -> ()");
  // output[t] = sum_j topk_weights[t, j] * permuted[inv_perm[t, j]] (fp32 sum, rounded once).
  m.def(
      "moe_grouped_unpermute(Tensor permuted, Tensor inv_perm, Tensor? topk_weights, "
      "Tensor! output) -> ()");

  // ---- sampling ------------------------------------------------------------------------------
  // Structured output: logits[r, t] = -inf where bit t % 32 of bitmask[r, t / 32] is 0, for the
  // rows r in indices (all rows when None). logits: [num_rows, vocab_size] fp32/fp16/bf16;
  // bitmask: [num_rows, ceil(vocab_size / 32)] int32; indices: [k] int32.
  m.def("apply_token_bitmask_inplace(Tensor! logits, Tensor bitmask, Tensor? indices) -> ()");
  // One token per row from softmax(logits / temperature) by the exponential race with Philox
  // noise keyed by seeds (cuda/include/pyorch/sampling.h); temperature <= 0: the row's argmax.
  // out: [num_rows] int64; logits: [num_rows, vocab_size] fp32/fp16/bf16; temperature:
  // [num_rows] float32; seeds: [num_rows] int64.
  m.def(
      "random_sample_from_logits(Tensor! out, Tensor logits, Tensor temperature, Tensor seeds) "
      "-> ()");

  // ---- MoE decode pair and grouped top-k (cuda/include/pyorch/moe_decode.h) ------------------
  // Few tokens: out [M, H] = sum over the pairs f of token t of topk_weights[t, j] * (act[f] @
  // w2[e]^T) with act [M * top_k, I] = silu(x @ gate_e^T) * (x @ up_e^T) (also written), over
  // moe_align_block_size's sort for block_size (CUDA: 8 or 16, M <= 128). fp32 sums, rounded once.
  m.def(
      "fused_moe_decode(Tensor! out, Tensor! act, Tensor hidden_states, Tensor w13, Tensor w2, "
      "Tensor topk_weights, Tensor sorted_token_ids, Tensor expert_ids, "
      "Tensor num_tokens_post_padded, int block_size, bool? pdl=None) -> ()");
  // vLLM's grouped_topk: scores = softmax/sigmoid(gating_output [M, E]); the topk_group best of
  // num_expert_group groups (by max, or top-2 sum with e_score_correction_bias [E]), then the
  // top_k experts among them by scores (+ bias); weights = their scores, renormalized, times
  // routed_scaling_factor. topk_weights [M, top_k] fp32, topk_ids [M, top_k] int32/int64.
  m.def(
      "grouped_topk(Tensor! topk_weights, Tensor! topk_ids, Tensor gating_output, "
      "int num_expert_group, int topk_group, bool renormalize, str scoring_func, "
      "float routed_scaling_factor, Tensor? e_score_correction_bias=None) -> ()");

  // ---- W4A16: 4-bit weights x 16-bit activations (GPTQ, AWQ; pyorch/_ops.py says how) --------
  // GPTQ qweight [size_k / 8, size_n] int32 (perm: act-order, [size_k] int32 or None) / AWQ
  // qweight [size_k, size_n / 8] -> pyorch's w4 tiles [size_n / 16, size_k * 2] int32.
  m.def(
      "gptq_marlin_repack(Tensor b_q_weight, Tensor? perm, SymInt size_k, SymInt size_n, "
      "int num_bits) -> Tensor");
  m.def(
      "awq_marlin_repack(Tensor b_q_weight, SymInt size_k, SymInt size_n, int num_bits) -> Tensor");
  // a [size_m, size_k] @ dequant(b_q_weight) -> [size_m, size_n] (into c when given); b_scales
  // [num_groups, size_n], b_zeros [num_groups, size_n / 8] (uint4), b_q_type a vLLM ScalarType id.
  m.def(
      "gptq_marlin_gemm(Tensor a, Tensor? c_or_none, Tensor b_q_weight, Tensor b_scales, "
      "Tensor? b_zeros_or_none, Tensor? perm_or_none, Tensor workspace, int b_q_type, "
      "SymInt size_m, SymInt size_n, SymInt size_k) -> Tensor");

  // ---- quantization (vLLM's schemas; shapes and checks in cpp/quantization_checks.h) ---------
  // fp8 e4m3: out = saturate(round_to_nearest_even(input / scale)); input [..., hidden]
  // fp32/fp16/bf16, out float8_e4m3fn (a 2-D out may have extra rows, left unwritten).
  // static: scale [1] given; dynamic: scale [1] = max(absmax(input) / 448, 1 / (448 * 512));
  // per token: scale [num_tokens, 1] = max(min(absmax(row), scale_ub) / 448, 1 / (448 * 512)).
  m.def("static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale) -> ()");
  m.def("dynamic_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale) -> ()");
  m.def(
      "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale, "
      "Tensor? scale_ub) -> ()");
  // int8: out = saturate(round(input / scale) + azp). static: scale [1] (and azp [1] int32 when
  // asymmetric); dynamic, per token: scale [num_tokens, 1] = absmax / 127, or with azp
  // [num_tokens, 1] int32 the row's [min, max] mapped onto [-128, 127].
  // RMSNorm (after residual += input, written back, when residual is given; input is not
  // written) then the per-token fp8 quantization of the normed row, rounded as rms_norm rounds it:
  // result float8_e4m3fn [num_tokens, hidden], scale [num_tokens, 1] (capped by scale_ub as above).
  m.def(
      "rms_norm_dynamic_per_token_quant(Tensor! result, Tensor input, Tensor weight, Tensor! "
      "scale, float epsilon, Tensor? scale_ub, Tensor!? residual) -> ()");
  // silu_and_mul then the per-token fp8 quantization of its rows, rounded as silu_and_mul rounds
  // them (pyorch's op; vLLM's silu_and_mul_quant takes a static scale): input [..., 2 * d] (gate
  // then up), result float8_e4m3fn [..., d], scale [num_tokens, 1] (capped by scale_ub as above).
  m.def(
      "silu_and_mul_dynamic_per_token_quant(Tensor! result, Tensor input, Tensor! scale, Tensor? "
      "scale_ub) -> ()");
  m.def("static_scaled_int8_quant(Tensor! result, Tensor input, Tensor scale, Tensor? azp) -> ()");
  m.def(
      "dynamic_scaled_int8_quant(Tensor! result, Tensor input, Tensor! scale, Tensor!? azp) -> "
      "()");
  // Groups of group_size along K: output_s [M, K / group_size] (any strides) = max(absmax, eps)
  // / fp8_max (rounded up to a power of two when scale_ue8m0); output_q = clamp(x / s).
  m.def(
      "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, "
      "float eps, float fp8_min, float fp8_max, bool scale_ue8m0) -> ()");
  // out [M, N] = (a [M, K] @ b [K, N]) * a_scales * b_scales (+ bias [N]); a row-major, b
  // column-major (weight.t()); fp8 or int8 in, bf16/fp16/fp32 out. Scales: a [1] or [M], b [1]
  // or [N]; or block-wise a [M, ceil(K/128)], b [ceil(K/128), ceil(N/128)] (fp8).
  m.def(
      "cutlass_scaled_mm(Tensor! out, Tensor a, Tensor b, Tensor a_scales, Tensor b_scales, "
      "Tensor? bias) -> ()");
  // int8 with asymmetric activations: out = a_scales * b_scales * (a @ b - azp_adj) with a
  // per-tensor azp folded into azp_adj [N] (= azp * colsum(b)), or (a @ b - azp[m] * azp_adj[n])
  // with a per-token azp [M] int32 (azp_adj = colsum(b)).
  m.def(
      "cutlass_scaled_mm_azp(Tensor! out, Tensor a, Tensor b, Tensor a_scales, Tensor b_scales, "
      "Tensor azp_adj, Tensor? azp, Tensor? bias) -> ()");
  // ---- GGUF (vLLM's ggml ops) -----------------------------------------------------------------
  // W: a GGUF tensor's raw blocks (any dtype, read as bytes, contiguous; usually uint8
  // [rows, cols / block_size * type_size]); quant_type: the GGML type id
  // (gguf.GGMLQuantizationType). Returns W dequantized as [m, n] of dtype (default float16).
  m.def(
      "ggml_dequantize(Tensor W, int quant_type, SymInt m, SymInt n, ScalarType? dtype) -> Tensor");
  // Returns X @ W^T: X [num_tokens, cols] fp32/fp16/bf16, W `row` rows of cols; out [num_tokens,
  // row] of X's dtype. X is quantized to 8 bits per 32 values and dotted with the blocks in
  // integer arithmetic. _vec_ is meant for few tokens (decode), mul_mat for more.
  m.def("ggml_mul_mat_vec_a8(Tensor W, Tensor X, int quant_type, SymInt row) -> Tensor");
  m.def("ggml_mul_mat_a8(Tensor W, Tensor X, int quant_type, SymInt row) -> Tensor");
  // CPU only: the same product from Q4_0 / Q4_1 / Q8_0 rows repacked in groups of 8 (the layout
  // in cpp/cpu/gguf.cpp; pyorch.layers.quantization.gguf.repack_blocks writes it); row % 8 == 0.
  m.def("ggml_mul_mat_repacked_a8(Tensor W, Tensor X, int quant_type, SymInt row) -> Tensor");
  // CPU only, the decode layer's neighbours fused in (pyorch/layers/fused_linear.py): with
  // norm_weight, X is RMSNorm'ed first; epilogue "store" (out = y), "add" (out += y) or
  // "silu_and_mul" (out = silu(y[:, :row/2]) * y[:, row/2:]), y = X' @ W^T + bias.
  m.def(
      "ggml_mul_mat_repacked_fused(Tensor(a!) out, Tensor X, Tensor W, int quant_type, SymInt row, "
      "Tensor? bias, Tensor? norm_weight, float eps, str epilogue) -> ()");
  // The file's layout, the decode layer's neighbours fused in on CUDA (one token of Q4_K: one
  // kernel; elsewhere, and on the CPU, the ops it fuses in turn): out (= or, epilogue "add", +=)
  // f(X) @ W^T, f by input_op: "none", "rms_norm" (with norm_weight, eps) or "silu_and_mul" (X
  // [num_tokens, 2 * cols]: silu(X[:, :cols]) * X[:, cols:]).
  m.def(
      "ggml_mul_mat_vec_fused(Tensor(a!) out, Tensor X, Tensor W, int quant_type, SymInt row, "
      "Tensor? norm_weight, float eps, str input_op, str epilogue) -> ()");

  // ---- CPU kernels ---------------------------------------------------------------------------
  m.impl("rms_norm", c10::kCPU, &pyorch::cpu::rms_norm);
  m.impl("fused_add_rms_norm", c10::kCPU, &pyorch::cpu::fused_add_rms_norm);
  m.impl("paged_attention", c10::kCPU, &pyorch::cpu::paged_attention);
  m.impl("merge_attn_states", c10::kCPU, &pyorch::cpu::merge_attn_states);
  m.impl("cascade_attention", c10::kCPU, &pyorch::cpu::cascade_attention);
  m.impl("paged_attention_v1", c10::kCPU, &pyorch::cpu::paged_attention_v1);
  m.impl("paged_attention_v2", c10::kCPU, &pyorch::cpu::paged_attention_v2);
  m.impl("rotary_embedding", c10::kCPU, &pyorch::cpu::rotary_embedding);
  m.impl("rotary_embedding_and_cache", c10::kCPU, &pyorch::cpu::rotary_embedding_and_cache);
  m.impl("silu_and_mul", c10::kCPU, &pyorch::cpu::silu_and_mul);
  m.impl("gelu_and_mul", c10::kCPU, &pyorch::cpu::gelu_and_mul);
  m.impl("gelu_tanh_and_mul", c10::kCPU, &pyorch::cpu::gelu_tanh_and_mul);
  m.impl("reshape_and_cache", c10::kCPU, &pyorch::cpu::reshape_and_cache);
  m.impl("reshape_and_cache_flash", c10::kCPU, &pyorch::cpu::reshape_and_cache_flash);
  m.impl("copy_blocks", c10::kCPU, &pyorch::cpu::copy_blocks);
  m.impl("swap_blocks", c10::kCPU, &pyorch::cpu::swap_blocks);
  m.impl("skinny_gemm", c10::kCPU, &pyorch::cpu::skinny_gemm);
  m.impl("skinny_gemm_fused", c10::kCPU, &pyorch::cpu::skinny_gemm_fused);
  m.impl("topk_softmax", c10::kCPU, &pyorch::cpu::topk_softmax);
  m.impl("moe_sum", c10::kCPU, &pyorch::cpu::moe_sum);
  m.impl("moe_align_block_size", c10::kCPU, &pyorch::cpu::moe_align_block_size);
  m.impl("fused_moe_gemm", c10::kCPU, &pyorch::cpu::fused_moe_gemm);
  m.impl("fused_moe_decode", c10::kCPU, &pyorch::cpu::fused_moe_decode);
  m.impl("grouped_topk", c10::kCPU, &pyorch::cpu::grouped_topk);
  m.impl("apply_token_bitmask_inplace", c10::kCPU, &pyorch::cpu::apply_token_bitmask_inplace);
  m.impl("random_sample_from_logits", c10::kCPU, &pyorch::cpu::random_sample_from_logits);
  m.impl("gptq_marlin_repack", c10::kCPU, &pyorch::cpu::gptq_marlin_repack);
  m.impl("awq_marlin_repack", c10::kCPU, &pyorch::cpu::awq_marlin_repack);
  m.impl("gptq_marlin_gemm", c10::kCPU, &pyorch::cpu::gptq_marlin_gemm);
  // quantization
  m.impl("static_scaled_fp8_quant", c10::kCPU, &pyorch::cpu::static_scaled_fp8_quant);
  m.impl("dynamic_scaled_fp8_quant", c10::kCPU, &pyorch::cpu::dynamic_scaled_fp8_quant);
  m.impl("dynamic_per_token_scaled_fp8_quant", c10::kCPU,
         &pyorch::cpu::dynamic_per_token_scaled_fp8_quant);
  m.impl("static_scaled_int8_quant", c10::kCPU, &pyorch::cpu::static_scaled_int8_quant);
  m.impl("dynamic_scaled_int8_quant", c10::kCPU, &pyorch::cpu::dynamic_scaled_int8_quant);
  m.impl("per_token_group_fp8_quant", c10::kCPU, &pyorch::cpu::per_token_group_fp8_quant);
  m.impl("rms_norm_dynamic_per_token_quant", c10::kCPU,
         &pyorch::cpu::rms_norm_dynamic_per_token_quant);
  m.impl("silu_and_mul_dynamic_per_token_quant", c10::kCPU,
         &pyorch::cpu::silu_and_mul_dynamic_per_token_quant);
  m.impl("cutlass_scaled_mm", c10::kCPU, &pyorch::cpu::cutlass_scaled_mm);
  m.impl("cutlass_scaled_mm_azp", c10::kCPU, &pyorch::cpu::cutlass_scaled_mm_azp);
  m.impl("ggml_dequantize", c10::kCPU, &pyorch::cpu::ggml_dequantize);
  m.impl("ggml_mul_mat_vec_a8", c10::kCPU, &pyorch::cpu::ggml_mul_mat_vec_a8);
  m.impl("ggml_mul_mat_a8", c10::kCPU, &pyorch::cpu::ggml_mul_mat_a8);
  m.impl("ggml_mul_mat_repacked_a8", c10::kCPU, &pyorch::cpu::ggml_mul_mat_repacked_a8);
  m.impl("ggml_mul_mat_repacked_fused", c10::kCPU, &pyorch::cpu::ggml_mul_mat_repacked_fused);
  m.impl("ggml_mul_mat_vec_fused", c10::kCPU, &pyorch::cpu::ggml_mul_mat_vec_fused);
  m.impl("skinny_gemm_fp8", c10::kCPU, &pyorch::cpu::skinny_gemm_fp8);
  m.impl("moe_grouped_permute", c10::kCPU, &pyorch::cpu::moe_grouped_permute);
  m.impl("moe_grouped_gemm", c10::kCPU, &pyorch::cpu::moe_grouped_gemm);
  m.impl("moe_grouped_unpermute", c10::kCPU, &pyorch::cpu::moe_grouped_unpermute);
  // @cpu-impls (keep this marker: areas add their m.impl lines above it)

#ifdef PYORCH_WITH_CUDA
  // ---- CUDA adapters -------------------------------------------------------------------------
  m.impl("rms_norm", c10::kCUDA, &rms_norm);
  m.impl("fused_add_rms_norm", c10::kCUDA, &fused_add_rms_norm);
  m.impl("paged_attention", c10::kCUDA, &paged_attention);
  m.impl("merge_attn_states", c10::kCUDA, &merge_attn_states);
  m.impl("cascade_attention", c10::kCUDA, &cascade_attention);
  m.impl("paged_attention_v1", c10::kCUDA, &paged_attention_v1);
  m.impl("paged_attention_v2", c10::kCUDA, &paged_attention_v2);
  m.impl("rotary_embedding", c10::kCUDA, &rotary_embedding);
  m.impl("rotary_embedding_and_cache", c10::kCUDA, &rotary_embedding_and_cache);
  m.impl("silu_and_mul", c10::kCUDA, &silu_and_mul);
  m.impl("gelu_and_mul", c10::kCUDA, &gelu_and_mul);
  m.impl("gelu_tanh_and_mul", c10::kCUDA, &gelu_tanh_and_mul);
  m.impl("reshape_and_cache", c10::kCUDA, &reshape_and_cache);
  m.impl("reshape_and_cache_flash", c10::kCUDA, &reshape_and_cache_flash);
  m.impl("copy_blocks", c10::kCUDA, &copy_blocks);
  m.impl("swap_blocks", c10::kCUDA, &swap_blocks);
  m.impl("skinny_gemm", c10::kCUDA, &skinny_gemm);
  m.impl("skinny_gemm_fused", c10::kCUDA, &skinny_gemm_fused);
  m.impl("custom_all_reduce", c10::kCUDA, &custom_all_reduce);
  m.impl("custom_all_reduce_init_buffer", c10::kCUDA, &custom_all_reduce_init_buffer);
  m.impl("custom_all_reduce_rms_norm", c10::kCUDA, &custom_all_reduce_rms_norm);
  m.impl("topk_softmax", c10::kCUDA, &topk_softmax);
  m.impl("moe_sum", c10::kCUDA, &moe_sum);
  m.impl("moe_align_block_size", c10::kCUDA, &moe_align_block_size);
  m.impl("fused_moe_gemm", c10::kCUDA, &fused_moe_gemm);
  m.impl("fused_moe_decode", c10::kCUDA, &fused_moe_decode);
  m.impl("grouped_topk", c10::kCUDA, &grouped_topk);
  m.impl("apply_token_bitmask_inplace", c10::kCUDA, &apply_token_bitmask_inplace);
  m.impl("random_sample_from_logits", c10::kCUDA, &random_sample_from_logits);
  // quantization (the scaled GEMMs' CUTLASS adapters add theirs below)
  m.impl("static_scaled_fp8_quant", c10::kCUDA, &static_scaled_fp8_quant);
  m.impl("dynamic_scaled_fp8_quant", c10::kCUDA, &dynamic_scaled_fp8_quant);
  m.impl("dynamic_per_token_scaled_fp8_quant", c10::kCUDA, &dynamic_per_token_scaled_fp8_quant);
  m.impl("static_scaled_int8_quant", c10::kCUDA, &static_scaled_int8_quant);
  m.impl("dynamic_scaled_int8_quant", c10::kCUDA, &dynamic_scaled_int8_quant);
  m.impl("per_token_group_fp8_quant", c10::kCUDA, &per_token_group_fp8_quant);
  m.impl("rms_norm_dynamic_per_token_quant", c10::kCUDA, &rms_norm_dynamic_per_token_quant);
  m.impl("silu_and_mul_dynamic_per_token_quant", c10::kCUDA, &silu_and_mul_dynamic_per_token_quant);
  m.impl("gptq_marlin_repack", c10::kCUDA, &gptq_marlin_repack);
  m.impl("awq_marlin_repack", c10::kCUDA, &awq_marlin_repack);
  m.impl("gptq_marlin_gemm", c10::kCUDA, &gptq_marlin_gemm);
  // the W8A8 CUTLASS GEMMs (cpp/ops/scaled_mm.cpp)
  m.impl("cutlass_scaled_mm", c10::kCUDA, &cutlass_scaled_mm);
  m.impl("cutlass_scaled_mm_azp", c10::kCUDA, &cutlass_scaled_mm_azp);
  m.impl("ggml_dequantize", c10::kCUDA, &ggml_dequantize);
  m.impl("ggml_mul_mat_vec_a8", c10::kCUDA, &ggml_mul_mat_vec_a8);
  m.impl("ggml_mul_mat_a8", c10::kCUDA, &ggml_mul_mat_a8);
  m.impl("ggml_mul_mat_vec_fused", c10::kCUDA, &ggml_mul_mat_vec_fused);
  m.impl("skinny_gemm_fp8", c10::kCUDA, &skinny_gemm_fp8);
  m.impl("moe_grouped_permute", c10::kCUDA, &moe_grouped_permute);
  m.impl("moe_grouped_gemm", c10::kCUDA, &moe_grouped_gemm);
  m.impl("moe_grouped_unpermute", c10::kCUDA, &moe_grouped_unpermute);
  // @cuda-impls (keep this marker: areas add their m.impl lines above it)
#endif
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyorch op library: registers torch.ops.pyorch.* and binds the block pool.";
#ifdef PYORCH_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  pyorch::block::bind_block_manager(m);
#ifdef PYORCH_WITH_CUDA
  // Process-wide launch settings of the C API (cuda/include/pyorch/launch.h): state, not a tensor
  // op, so a plain function here rather than a schema in TORCH_LIBRARY. pyorch/_ops.py sets
  // PDL from PYORCH_PDL right after loading this module.
  m.def("set_pdl_enabled", &pyorch::set_pdl_enabled, py::arg("enabled"),
        "Turn programmatic dependent launch on or off for the pyorch kernels launched after.");
  m.def("pdl_enabled", &pyorch::pdl_enabled,
        "Whether pyorch kernels launch with PDL on the current device (setting and GPU).");
  m.def("set_skinny_gemm_legacy_picks", &pyorch::set_skinny_gemm_legacy_picks, py::arg("on"),
        "Launch the skinny GEMMs (fp16/bf16 and fp8 weights) with their pre-2 GB-sweep picks.");
  m.def("skinny_gemm_legacy_picks", &pyorch::skinny_gemm_legacy_picks,
        "Whether the skinny GEMMs use their legacy launch picks.");
  m.def(
      "set_skinny_gemm_fp8_override",
      [](int form, int num_warps, int l2_prefetch, int prefetch_slices, int pdl, int stage_x) {
        TORCH_CHECK(form >= 0 && form < pyorch::kSkinnyFp8NumForms,
                    "set_skinny_gemm_fp8_override: form must be 0 (plain), 1 (normed), 2 (normed "
                    "+ silu_and_mul) or 3 (add), got ",
                    form);
        TORCH_CHECK(num_warps == -1 || num_warps == 4 || num_warps == 8,
                    "set_skinny_gemm_fp8_override: num_warps must be 4, 8 or -1, got ", num_warps);
        TORCH_CHECK(l2_prefetch >= -1 && l2_prefetch <= 1 && pdl >= -1 && pdl <= 1 &&
                        stage_x >= -1 && stage_x <= 1,
                    "set_skinny_gemm_fp8_override: l2_prefetch, pdl and stage_x must be 0, 1 or "
                    "-1");
        TORCH_CHECK(stage_x == -1 || form == pyorch::kSkinnyFp8Normed ||
                        form == pyorch::kSkinnyFp8NormedSilu,
                    "set_skinny_gemm_fp8_override: stage_x applies to the normed forms only (1 "
                    "normed, 2 normed + silu_and_mul), got it for form ",
                    form);
        TORCH_CHECK(prefetch_slices >= -1 && prefetch_slices <= 64,
                    "set_skinny_gemm_fp8_override: prefetch_slices must be in [-1, 64], got ",
                    prefetch_slices);
        pyorch::SkinnyGemmConfig config;
        config.num_warps = num_warps;
        config.l2_prefetch = l2_prefetch;
        config.prefetch_slices = prefetch_slices;
        config.pdl = pdl;
        config.stage_x = stage_x;
        pyorch::set_skinny_gemm_fp8_override(form, config);
      },
      py::arg("form"), py::arg("num_warps") = -1, py::arg("l2_prefetch") = -1,
      py::arg("prefetch_slices") = -1, py::arg("pdl") = -1, py::arg("stage_x") = -1,
      "Override skinny_gemm_fp8's launch picks for one form (0 plain, 1 normed, 2 normed + "
      "silu_and_mul, 3 add); -1 keeps a pick. Set before CUDA graphs are captured.");
  m.def("set_gguf_q4k_direct", &pyorch::set_gguf_q4k_direct, py::arg("on"),
        "Whether one token's Q4_K GGUF product may take its direct form (else the ring form).");
  m.def("gguf_q4k_direct", &pyorch::gguf_q4k_direct,
        "Whether one token's Q4_K GGUF product may take its direct form.");
  m.def("set_gguf_fused_warps", &pyorch::set_gguf_fused_warps, py::arg("warps"),
        "Warps per thread block of ggml_mul_mat_vec_fused's one-token Q4_K kernel (1..32, "
        "clamped).");
  m.def("gguf_fused_warps", &pyorch::gguf_fused_warps,
        "Warps per thread block of ggml_mul_mat_vec_fused's one-token Q4_K kernel.");
  m.def("set_moe_decode_legacy_picks", &pyorch::set_moe_decode_legacy_picks, py::arg("on"),
        "Launch the decode MoE pair with its picks from before the bench_moe_decode sweep.");
  m.def("moe_decode_legacy_picks", &pyorch::moe_decode_legacy_picks,
        "Whether the decode MoE pair uses its legacy launch picks.");
  m.def("set_w4a16_prefetch_acts", &pyorch::set_w4a16_prefetch_acts, py::arg("on"),
        "Whether the W4A16 stream kernel loads the next k-block's activations early.");
  m.def("w4a16_prefetch_acts", &pyorch::w4a16_prefetch_acts,
        "Whether the W4A16 stream kernel prefetches activations.");
  m.def("set_w4a16_stream_chunk", &pyorch::set_w4a16_stream_chunk, py::arg("blocks"),
        "k-blocks per ring slot of the W4A16 stream kernel for groups of 64+ rows (4 or 8).");
  m.def("w4a16_stream_chunk", &pyorch::w4a16_stream_chunk,
        "k-blocks per ring slot of the W4A16 stream kernel for groups of 64+ rows.");
  m.def("set_w4a16_stream_scales_by_copy", &pyorch::set_w4a16_stream_scales_by_copy, py::arg("on"),
        "Whether the W4A16 stream kernel brings the scales of groups of 128 by bulk copies.");
  m.def("w4a16_stream_scales_by_copy", &pyorch::w4a16_stream_scales_by_copy,
        "Whether the W4A16 stream kernel brings the scales of groups of 128 by bulk copies.");
  m.def("set_w4a16_stream_stages", &pyorch::set_w4a16_stream_stages, py::arg("stages"),
        "Ring slots per warp of the W4A16 stream kernel (1..8; powers of two for groups of 64+).");
  m.def("w4a16_stream_stages", &pyorch::w4a16_stream_stages,
        "Ring slots per warp of the W4A16 stream kernel.");
  m.def("w4a16_num_splits", &pyorch::w4a16_num_splits, py::arg("size_m"), py::arg("size_n"),
        py::arg("size_k"), "The k-split gptq_marlin_gemm uses for a shape (1: none).");
  m.def("set_w4a16_tiled_min_rows", &pyorch::set_w4a16_tiled_min_rows, py::arg("rows"),
        "The row count from which gptq_marlin_gemm runs its tiled kernel (1..65, clamped).");
  m.def("w4a16_tiled_min_rows", &pyorch::w4a16_tiled_min_rows,
        "The row count from which gptq_marlin_gemm runs its tiled kernel.");
  m.def("set_w4a16_mma_max_rows", &pyorch::set_w4a16_mma_max_rows, py::arg("rows"),
        "Above this many rows gptq_marlin_gemm dequantizes the weight and calls cuBLAS (0: auto).");
  m.def("w4a16_mma_max_rows", &pyorch::w4a16_mma_max_rows,
        "The row limit of gptq_marlin_gemm's own kernels (0: auto, by rows and weight size).");
  m.def("w4a16_mma_path", &pyorch::w4a16_mma_path, py::arg("size_m"), py::arg("size_n"),
        py::arg("size_k"),
        "Whether gptq_marlin_gemm runs its own kernel (else dequantize + cuBLAS) for this shape.");
  m.def("w4a16_kernel_name", &pyorch::w4a16_kernel_name, py::arg("size_m"),
        "The CUDA kernel gptq_marlin_gemm runs for size_m rows (stream, registers or tiled).");
  m.def("w4a16_stream_acts_ahead", &pyorch::w4a16_stream_acts_ahead, py::arg("size_m"),
        py::arg("size_n"), py::arg("size_k"),
        "Whether the stream kernel's 9..16-row form loads activations a k-block ahead (else its "
        "leaner form, for more resident blocks).");
  m.def(
      "set_custom_all_reduce_rms_norm_split",
      [](const std::string& mode) {
        using S = pyorch::AllReduceNormSplit;
        if (mode != "off" && mode != "on" && mode != "auto") {
          throw py::value_error(
              "set_custom_all_reduce_rms_norm_split: mode must be 'off', 'on' "
              "or 'auto', got '" +
              mode + "'");
        }
        pyorch::set_custom_all_reduce_rms_norm_split(mode == "off"  ? S::kOff
                                                     : mode == "on" ? S::kOn
                                                                    : S::kAuto);
      },
      py::arg("mode"),
      "Split the fused all-reduce + RMSNorm's rows over several blocks: 'off', 'on' or 'auto' "
      "(the default: at most 4 rows).");
  m.def(
      "custom_all_reduce_rms_norm_split",
      [] {
        switch (pyorch::custom_all_reduce_rms_norm_split()) {
          case pyorch::AllReduceNormSplit::kOff: return std::string("off");
          case pyorch::AllReduceNormSplit::kOn: return std::string("on");
          default: return std::string("auto");
        }
      },
      "The fused all-reduce + RMSNorm's split mode: 'off', 'on' or 'auto'.");
  // CUDA IPC for the custom all-reduce: a buffer's handle (64 bytes) to share with the peers,
  // mapping a peer's handle into this process (on the current device) and unmapping it.
  m.def("custom_all_reduce_buffer_size", &pyorch::custom_all_reduce_buffer_size,
        py::arg("max_bytes"), "Bytes of one rank's custom all-reduce buffer.");
  m.def("custom_all_reduce_push_bytes", &pyorch::custom_all_reduce_push_bytes, py::arg("max_bytes"),
        "Largest message of the push kernels (algo 3, the fused norm).");
  m.def(
      "ipc_handle_of", [](int64_t ptr) { return py::bytes(pyorch::ipc_handle_of(ptr)); },
      py::arg("ptr"), "The CUDA IPC handle (bytes) of a cudaMalloc'd device address.");
  m.def("ipc_open", &pyorch::ipc_open, py::arg("handle"),
        "Maps a peer's CUDA IPC handle; returns the device address in this process.");
  m.def("ipc_close", &pyorch::ipc_close, py::arg("ptr"), "Unmaps an address from ipc_open.");
#endif
  m.def("gguf_cpu_isa", &pyorch::cpu::gguf_cpu_isa, py::arg("name") = "",
        "The instruction set of the CPU GGUF products (sets it first unless name is empty).");
#ifdef PYORCH_WITH_CUDA
  // Whether cuda/ was compiled with the CUTLASS headers: without them the CUDA cutlass_scaled_mm
  // ops are registered but raise "built without CUTLASS" (cuda/include/pyorch/scaled_mm.h).
  m.def("cutlass_scaled_mm_available", &pyorch::cutlass_scaled_mm_available,
        "Whether the CUTLASS W8A8 GEMMs (cutlass_scaled_mm, cutlass_scaled_mm_azp) were built.");
#endif
#ifdef PYORCH_WITH_CUDA
  // Whether cuda/ was compiled with the CUTLASS headers: without them the CUDA moe_grouped_gemm
  // is registered but raises "built without CUTLASS" (cuda/include/pyorch/moe_grouped.h).
  m.def("moe_grouped_gemm_available", &pyorch::moe_grouped_gemm_available,
        "Whether the CUTLASS grouped expert GEMM (moe_grouped_gemm) was built.");
#endif
  // @pybind (keep this marker)
}
