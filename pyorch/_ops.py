"""Typed one-line wrappers over torch.ops.pyorch.* (the schemas live in cpp/torch_bindings.cpp).

Every op mutates its output arguments in place and returns None, like vLLM's _custom_ops.
"""

import math
from typing import Optional

import torch

from pyorch import _C, envs  # _C registers the ops
from pyorch.scalar_type import ScalarType

SKINNY_FP8_FORMS = {"plain": 0, "normed": 1, "normed_silu": 2, "add": 3}


def parse_skinny_fp8_override(spec: str) -> dict[str, tuple[int, int, int, int, int]]:
    """PYORCH_SKINNY_FP8_OVERRIDE's syntax, e.g. "normed=4,1,2,1;add=-1,-1,-1,1": per form,
    skinny_gemm_fp8's (num_warps, l2_prefetch, prefetch_slices, pdl[, stage_x]), -1 keeping a
    pick (stage_x left out: -1); forms left out keep every pick. Raises ValueError naming a
    malformed entry."""
    configs = {form: (-1, -1, -1, -1, -1) for form in SKINNY_FP8_FORMS}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        form, _, fields = entry.partition("=")
        values = fields.split(",")
        if form.strip() not in SKINNY_FP8_FORMS or len(values) not in (4, 5):
            raise ValueError(
                f"PYORCH_SKINNY_FP8_OVERRIDE: {entry!r} is not "
                f"FORM=WARPS,L2,PREFETCH,PDL[,STAGE_X] with FORM one of {sorted(SKINNY_FP8_FORMS)}")
        try:
            configs[form.strip()] = tuple(  # type: ignore[assignment]
                [int(v) for v in values] + [-1] * (5 - len(values)))
        except ValueError:
            raise ValueError(
                f"PYORCH_SKINNY_FP8_OVERRIDE: {entry!r} has a non-integer field") from None
    return configs


def set_skinny_fp8_override(spec: str) -> None:
    """Sets skinny_gemm_fp8's launch overrides from `spec` (parse_skinny_fp8_override; CUDA
    builds only). The C API range-checks each field."""
    for form, (warps, l2, prefetch, pdl, stage_x) in parse_skinny_fp8_override(spec).items():
        _C.set_skinny_gemm_fp8_override(SKINNY_FP8_FORMS[form], warps, l2, prefetch, pdl, stage_x)


if _C.with_cuda:  # the kernels' launch switches are process state of the C API
    _C.set_pdl_enabled(envs.PYORCH_PDL)  # pyorch/launch.h
    _C.set_skinny_gemm_legacy_picks(envs.PYORCH_SKINNY_GEMM_LEGACY_PICKS)  # pyorch/gemm.h
    _C.set_moe_decode_legacy_picks(envs.PYORCH_MOE_DECODE_LEGACY_PICKS)  # pyorch/moe_decode.h
    _C.set_gguf_q4k_direct(envs.PYORCH_GGUF_Q4K_DIRECT)  # pyorch/gguf.h
    if envs.PYORCH_SKINNY_FP8_OVERRIDE:
        set_skinny_fp8_override(envs.PYORCH_SKINNY_FP8_OVERRIDE)
    if envs.PYORCH_GGUF_FUSED_WARPS is not None:
        _C.set_gguf_fused_warps(envs.PYORCH_GGUF_FUSED_WARPS)  # pyorch/gguf.h
    _C.set_w4a16_prefetch_acts(envs.PYORCH_W4A16_PREFETCH_ACTS)  # pyorch/w4a16.h
    if envs.PYORCH_W4A16_TILED_MIN_ROWS is not None:
        _C.set_w4a16_tiled_min_rows(envs.PYORCH_W4A16_TILED_MIN_ROWS)
    if envs.PYORCH_W4A16_MMA_MAX_ROWS is not None:
        _C.set_w4a16_mma_max_rows(envs.PYORCH_W4A16_MMA_MAX_ROWS)
    _C.set_custom_all_reduce_rms_norm_split(envs.PYORCH_FUSED_ALLREDUCE_RMS_NORM_SPLIT)

_ops = torch.ops.pyorch


# ---- norms --------------------------------------------------------------------------------------
def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out[..., h] = input / sqrt(mean(input^2) + eps) * weight."""
    _ops.rms_norm(out, input, weight, eps)


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """residual += input; input = rms_norm(residual) * weight, both in place."""
    _ops.fused_add_rms_norm(input, residual, weight, eps)


# ---- attention ----------------------------------------------------------------------------------
def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    causal: bool,
    sliding_window: int,
    logits_soft_cap: float,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    lse: Optional[torch.Tensor] = None,
) -> None:
    """Attention of a mixed batch (prefills, chunked prefills, decodes) over the NHD paged cache.

    Parameters
    ----------
    out, query : [num_tokens, num_heads, head_size]; query may have any token/head stride.
    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, head_size], already holding
        the new tokens' KV; uint8/float8_e4m3fn when kv_cache_dtype is "fp8"/"fp8_e4m3".
    query_start_loc : [num_seqs + 1] int32, cumulative query lengths.
    seq_lens : [num_seqs] int32, cached + new tokens; a sequence's queries are its last positions.
    block_table : [num_seqs, max_blocks_per_seq] int32.
    max_query_len, max_seq_len : host-side upper bounds (CUDA uses them to pick the KV split).
    sliding_window : > 0 keeps keys with position > pos - sliding_window; logits_soft_cap > 0
        applies cap * tanh(s / cap) to the scaled scores. Rows past query_start_loc[-1] untouched.
    k_scale, v_scale : [1] float32 dequantization scales of an fp8 cache.
    lse : optional [num_heads, >= num_tokens] float32 (contiguous rows): receives each query row's
        natural-log log-sum-exp of its scaled scores (-inf for a row that sees no key), the form
        merge_attn_states combines (cascade attention: a shared prefix and each request's suffix
        attended separately, then merged).
    """
    _ops.paged_attention(
        out,
        query,
        key_cache,
        value_cache,
        query_start_loc,
        seq_lens,
        block_table,
        max_query_len,
        max_seq_len,
        scale,
        causal,
        sliding_window,
        logits_soft_cap,
        kv_cache_dtype,
        k_scale,
        v_scale,
        lse,
    )


def cascade_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    suffix_seq_lens: torch.Tensor,
    suffix_block_table: torch.Tensor,
    max_query_len: int,
    suffix_max_seq_len: int,
    perm: torch.Tensor,
    prefix_query_start_loc: torch.Tensor,
    prefix_seq_lens: torch.Tensor,
    prefix_block_table: torch.Tensor,
    prefix_max_query_len: int,
    prefix_max_seq_len: int,
    scale: float,
    logits_soft_cap: float,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Causal attention over shared prefixes in one op (pyorch/executor/cascade.py): each
    sequence's own keys (suffix_seq_lens over suffix_block_table, its blocks after its prefix)
    into `out` with their log-sum-exp; then each group's prefix once, the rows `perm` lists (int64,
    group by group, prefix_query_start_loc over them) attending as one non-causal sequence over
    prefix_seq_lens / prefix_block_table; then each listed row's two parts merged in place.
    Arguments otherwise as paged_attention's (no sliding window)."""
    _ops.cascade_attention(
        out, query, key_cache, value_cache, query_start_loc, suffix_seq_lens, suffix_block_table,
        max_query_len, suffix_max_seq_len, perm, prefix_query_start_loc, prefix_seq_lens,
        prefix_block_table, prefix_max_query_len, prefix_max_seq_len, scale, logits_soft_cap,
        kv_cache_dtype, k_scale, v_scale,
    )


def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: Optional[torch.Tensor] = None,
) -> None:
    """Merges two partial attentions by log-sum-exp (vLLM's argument order).

    outputs: [num_tokens, num_heads, head_size]; lse: [num_heads, num_tokens] float32 (natural
    log). An lse of +inf counts as -inf (an empty part); when both parts are empty the output is
    zeros and output_lse -inf.
    """
    _ops.merge_attn_states(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse)


# ---- vLLM's split-layout paged attention (decode only) ------------------------------------------
def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: Optional[torch.Tensor],
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
) -> None:
    """Decode attention of one query token per sequence over vLLM's split KV layout (one pass).

    out/query: [num_seqs, num_heads, head_size]; key_cache: [num_blocks, num_kv_heads,
    head_size // x, block_size, x] with x = 16 // element size; value_cache: [num_blocks,
    num_kv_heads, head_size, block_size]; block_tables: [num_seqs, max_blocks_per_seq] int32;
    seq_lens: [num_seqs] int32; alibi_slopes: [num_heads] float32 or None; k_scale/v_scale:
    one-element float32 tensors, used when kv_cache_dtype is "fp8"/"fp8_e4m3". Blocksparse
    attention is not supported (blocksparse_vert_stride > 1 or blocksparse_local_blocks != 0 raise).
    """
    _ops.paged_attention_v1(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
        block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank,
        blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
        blocksparse_head_sliding_step,
    )  # fmt: skip


def paged_attention_v2(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: Optional[torch.Tensor],
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
) -> None:
    """paged_attention_v1 split over 512-token partitions, then reduced into out.

    Scratch, caller-allocated with max_num_partitions = ceil(max_seq_len / 512):
    exp_sums, max_logits: [num_seqs, num_heads, max_num_partitions] float32;
    tmp_out: [num_seqs, num_heads, max_num_partitions, head_size] of query's dtype.
    """
    _ops.paged_attention_v2(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
        block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale,
        v_scale, tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
        blocksparse_block_size, blocksparse_head_sliding_step,
    )  # fmt: skip


# ---- rotary embedding ---------------------------------------------------------------------------
def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotates query (and key) in place by each token's position, vLLM style.

    positions: [num_tokens] int64; query: [num_tokens, num_heads * head_size] or
    [num_tokens, num_heads, head_size] (any token stride, last dim contiguous); key: the same with
    num_kv_heads, or None; cos_sin_cache: [max_position, rot_dim] = [cos | sin], in query's dtype
    or float32, rot_dim even and <= head_size (only the first rot_dim dims of a head rotate).
    is_neox rotates the pairs (i, i + rot_dim / 2), else the pairs (2i, 2i + 1).
    """
    _ops.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> None:
    """rotary_embedding(positions, query, key, ...) then reshape_and_cache_flash(key, value, ...),
    with the same results, in one kernel on CUDA.

    key, value: [num_tokens, num_kv_heads, head_size] (any token/head stride, last dim
    contiguous); the rest as those two ops take them. With q_norm_weight and k_norm_weight
    ([head_size], query's dtype; both or neither) every query and key head is RMS-normalized
    first, as rms_norm(head, weight, norm_eps) would (Qwen3's per-head q/k norm: vLLM's
    fused_qk_norm_rope, here with the cache write too). The norm needs rot_dim == head_size and
    a power-of-two head_size (see qk_norm_fusable).
    """
    _ops.rotary_embedding_and_cache(
        positions, query, key, value, head_size, cos_sin_cache, is_neox, key_cache, value_cache,
        slot_mapping, kv_cache_dtype, k_scale, v_scale, q_norm_weight, k_norm_weight, norm_eps,
    )


def qk_norm_fusable(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_size: int, rot_dim: int,
    q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
) -> bool:
    """Whether rotary_embedding_and_cache takes these q/k norm weights: whole heads rotate, a
    power-of-two head_size, weights of query's dtype and device, and on CUDA 16-byte aligned
    heads of at most 32 vectors per half (the kernel reduces a head's sum of squares over a
    group of at most a warp's threads)."""
    if rot_dim != head_size or head_size < 2 or head_size & (head_size - 1):
        return False
    weights = (q_norm_weight, k_norm_weight)
    if any(w.dtype != query.dtype or w.device != query.device or w.shape != (head_size,)
           or not w.is_contiguous() for w in weights):
        return False
    if not query.is_cuda:
        return True
    vec = 16 // query.element_size()
    tensors = (query, key, value, *weights)
    return (head_size // 2 // vec <= 32 and head_size // 2 % vec == 0
            and all(t.data_ptr() % 16 == 0 for t in tensors)
            and all(s % vec == 0 for t in (query, key, value) for s in t.stride()[:-1]))


# ---- activations --------------------------------------------------------------------------------
def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """out[..., d] = silu(input[..., :d]) * input[..., d:], computed in fp32, rounded once."""
    _ops.silu_and_mul(out, input)


def gelu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """out[..., d] = gelu(input[..., :d]) * input[..., d:] (exact erf gelu)."""
    _ops.gelu_and_mul(out, input)


def gelu_tanh_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """out[..., d] = gelu_tanh(input[..., :d]) * input[..., d:] (tanh approximation)."""
    _ops.gelu_tanh_and_mul(out, input)


# ---- KV cache -----------------------------------------------------------------------------------
def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Writes each token's key/value into its slot of NHD caches (slot = block_id * block_size +
    offset; a negative slot is padding and skipped).

    key, value: [num_tokens, num_kv_heads, head_size] (any token/head stride, last dim
    contiguous); key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size] (any
    block stride, same strides for both); slot_mapping: [num_tokens] int64. kv_cache_dtype "auto"
    stores key's dtype; "fp8" / "fp8_e4m3" stores fp8(clamp(x / scale, -448, 448)) into uint8 or
    float8_e4m3fn caches, with k_scale, v_scale one-element float32 tensors on key's device.
    """
    _ops.reshape_and_cache_flash(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """reshape_and_cache_flash for vLLM's split layout, x = 16 // cache element size:
    key_cache [num_blocks, num_kv_heads, head_size // x, block_size, x], value_cache
    [num_blocks, num_kv_heads, head_size, block_size] (any block/head stride, each head
    contiguous). head_size must be a multiple of x.
    """
    _ops.reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """For every layer, copies block src -> dst within its key and value cache.

    key_caches, value_caches: [num_layers] caches [num_blocks, ...] (either layout; each block
    contiguous); block_mapping: [num_pairs, 2] int64 (src, dst), on the caches' device or the CPU.
    A dst block must not be the src of another pair.
    """
    _ops.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies block src -> dst between two caches, CPU <-> CUDA (pin the CPU side for async
    copies), CUDA -> CUDA or CPU -> CPU. Copies involving CUDA are queued on the current stream.

    src: [num_src_blocks, ...], dst: [num_dst_blocks, ...] with the same block shape and dtype;
    block_mapping: [num_pairs, 2] int64 (src, dst) on the CPU.
    """
    _ops.swap_blocks(src, dst, block_mapping)


# ---- linear layers ------------------------------------------------------------------------------
def skinny_gemm(
    out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> None:
    """out = input @ weight^T (+ bias) for few rows: the decode-time linear layer.

    Parameters
    ----------
    out : [num_tokens, output_size], last dim contiguous (any row stride).
    input : [num_tokens, input_size] with num_tokens <= 16 and input_size % 8 == 0; last dim
        contiguous, row stride a multiple of 8, 16-byte aligned.
    weight : [output_size, input_size], contiguous and 16-byte aligned (nn.Linear's layout).
    bias : [output_size] or None.
    All float16 or all bfloat16; accumulated in float32 and rounded once; deterministic.
    """
    _ops.skinny_gemm(out, input, weight, bias)


# skinny_gemm_fused's epilogues, by name (the op takes their index).
SKINNY_EPILOGUES = {"store": 0, "silu_and_mul": 1, "add": 2}


def skinny_gemm_fused(
    out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor] = None,
    epsilon: float = 1e-6,
    epilogue: str = "store",
    pdl: Optional[bool] = None,
) -> None:
    """skinny_gemm with a decoder layer's neighbours fused in: one kernel instead of up to three.

    With norm_weight, the input is RMS-normed on the fly: p = inv_rms * ((input * norm_weight) @
    weight^T) + bias, inv_rms = rsqrt(mean(input^2) + epsilon) per row in float32, input *
    norm_weight rounded to the dtype (one rounding where rms_norm then skinny_gemm has two, so
    the result is close to that pair's, not bit-equal). Without it p = input @ weight^T + bias.

    epilogue:
      "store": out = p, as skinny_gemm.
      "silu_and_mul": weight is [gate; up] (2 * d rows, d = output_size / 2); out [num_tokens, d]
        = silu(gate) * up with gate and up rounded first: skinny_gemm then silu_and_mul.
      "add": out += p (rounded first), in place: the residual add. No norm_weight; out must not
        overlap input.

    Shapes and layouts as skinny_gemm; norm_weight: [input_size], contiguous, same dtype.
    pdl: launch with programmatic dependent launch (CUDA, Hopper; off under PYORCH_PDL=0). None:
    off, the measured default (in the fused decode layer GEMMs follow GEMMs, and an early-launched
    one slowed the one before it).
    """
    if epilogue not in SKINNY_EPILOGUES:
        raise ValueError(
            f"skinny_gemm_fused: epilogue must be one of {sorted(SKINNY_EPILOGUES)}, "
            f"got {epilogue!r}"
        )
    _ops.skinny_gemm_fused(
        out, input, weight, bias, norm_weight, epsilon, SKINNY_EPILOGUES[epilogue], pdl
    )


def skinny_gemm_fp8(
    out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor] = None,
    epsilon: float = 1e-6,
    epilogue: str = "store",
    pdl: Optional[bool] = None,
) -> None:
    """skinny_gemm_fused with float8_e4m3fn weights: the decode GEMM of the fp8 linear methods.

    p = weight_scale * (norm(input) @ weight^T) + bias, where weight's e4m3 values are widened
    exactly to input's dtype and the products summed in float32; the activations are NOT
    quantized (W8A16 numerics, closer to the float layer than the W8A8 cutlass_scaled_mm path).
    weight: [output_size, input_size] e4m3, contiguous, 16-byte aligned, input_size % 16 == 0.
    weight_scale: float32 [1] (per tensor) or [output_size] (per output channel; silu_and_mul:
    the gate's and the up's rows their own). norm_weight, epsilon, epilogue as
    skinny_gemm_fused; the rest as skinny_gemm (num_tokens <= 16).
    pdl (CUDA): None launches the plain form ("store", no norm) with PDL where available and the
    fused forms without, as skinny_gemm and skinny_gemm_fused do.
    """
    if epilogue not in SKINNY_EPILOGUES:
        raise ValueError(
            f"skinny_gemm_fp8: epilogue must be one of {sorted(SKINNY_EPILOGUES)}, "
            f"got {epilogue!r}"
        )
    _ops.skinny_gemm_fp8(
        out, input, weight, weight_scale, bias, norm_weight, epsilon, SKINNY_EPILOGUES[epilogue],
        pdl,
    )


def custom_all_reduce(
    out: torch.Tensor,  # [n]: the sum over the ranks (identical on every rank)
    input: torch.Tensor,  # [n] contiguous fp32/fp16/bf16, n * element size % 16 == 0
    buffers: list[int],  # [world_size] every rank's IPC buffer address in this process
    rank: int,
    max_bytes: int,  # the size the buffers were made for (input's bytes <= max_bytes)
    algo: int = 0,  # 0 auto, 1 one-shot, 2 two-shot, 3 one-shot push
) -> None:
    """pyorch's all-reduce over CUDA-IPC buffers (CUDA only; pyorch.distributed.custom_all_reduce
    sets the buffers up)."""
    torch.ops.pyorch.custom_all_reduce(out, input, buffers, rank, max_bytes, algo)


def custom_all_reduce_rms_norm(
    out: torch.Tensor,  # [rows, hidden]: RMSNorm(residual) * weight
    input: torch.Tensor,  # [rows, hidden]: this rank's partial sum
    residual: torch.Tensor,  # [rows, hidden]: += the all-reduce of input, in place
    weight: torch.Tensor,  # [hidden]
    epsilon: float,
    buffers: list[int],  # [world_size] every rank's IPC buffer address in this process
    rank: int,
    max_bytes: int,  # the size the buffers were made for
) -> None:
    """The fused all-reduce + residual add + RMSNorm (CUDA only, one kernel); the same roundings
    as custom_all_reduce then fused_add_rms_norm."""
    torch.ops.pyorch.custom_all_reduce_rms_norm(
        out, input, residual, weight, epsilon, buffers, rank, max_bytes
    )


def custom_all_reduce_init_buffer(buffer: torch.Tensor) -> None:
    """Zeroes the signal area of a fresh custom all-reduce buffer (uint8, on the rank's GPU)."""
    torch.ops.pyorch.custom_all_reduce_init_buffer(buffer)
# ---- mixture of experts -------------------------------------------------------------------------
def topk_softmax(
    topk_weights: torch.Tensor,
    topk_indices: torch.Tensor,
    token_expert_indices: torch.Tensor,
    gating_output: torch.Tensor,
    renormalize: bool,
) -> None:
    """The MoE router: softmax(gating_output) in float32, its top_k largest (ties to the lower
    expert id), renormalized to sum to 1 per token when `renormalize`.

    topk_weights : [num_tokens, top_k] float32 (out).
    topk_indices : [num_tokens, top_k] int32 or int64 (out): the chosen expert ids.
    token_expert_indices : [num_tokens, top_k] int32 (out): j * num_tokens + token.
    gating_output : [num_tokens, num_experts] float32/float16/bfloat16 (rows may be strided).
    """
    _ops.topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output, renormalize)


def moe_sum(input: torch.Tensor, output: torch.Tensor) -> None:
    """output [num_tokens, hidden] = input [num_tokens, top_k, hidden].sum(1) (float32 sum)."""
    _ops.moe_sum(input, output)


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    expert_map: Optional[torch.Tensor] = None,
) -> None:
    """Sorts the (token, expert) pairs of topk_ids [num_tokens, top_k] by expert, each expert's
    run padded to a multiple of block_size (the expert GEMM's row tile).

    sorted_token_ids : [>= num_flat + min(num_experts, num_flat) * (block_size - 1)] int32 (out):
        flat pair ids f = token * top_k + j, grouped by expert; padding holds num_flat.
    experts_ids : [one per block of sorted_token_ids] int32 (out): the block's expert, through
        expert_map [num_experts] int32 (global -> local id, -1 = not on this rank) when given;
        -1 past the end.
    num_tokens_post_pad : [1] int32 (out): the padded number of entries used.
    """
    _ops.moe_align_block_size(
        topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
        expert_map,
    )


def fused_moe_gemm(
    out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    topk_weights: Optional[torch.Tensor],
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    top_k: int,
    block_size: int,
    silu_and_mul: bool,
) -> None:
    """The grouped expert GEMM over moe_align_block_size's blocks, in one launch.

    For each flat pair id f in a block of expert e: c = input[f // top_k] @ weight[e]^T; out[f]
    = c, or silu(c[:N/2]) * c[N/2:] when silu_and_mul; times topk_weights[f] when given. Blocks
    of expert -1 (another rank's) write zeros.

    out : [num_flat, N or N / 2], contiguous. input : [num_flat / top_k, K] (last dim
    contiguous). weight : [num_experts, N, K], contiguous. topk_weights : [num_flat] float32 or
    None. Float32 accumulation, rounded once.
    """
    _ops.fused_moe_gemm(
        out, input, weight, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        top_k, block_size, silu_and_mul,
    )


# ---- MoE prefill path: permute, grouped expert GEMM, un-permute -------------------------------
def moe_grouped_permute(
    input: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert_map: Optional[torch.Tensor],
    permuted: torch.Tensor,
    expert_offsets: torch.Tensor,
    inv_perm: torch.Tensor,
) -> None:
    """Sorts the (token, expert) pairs of topk_ids [M, top_k] by local expert and gathers their
    token rows.

    expert_offsets : [num_local_experts + 1] int32 (out): local expert e's rows of permuted are
        [offsets[e], offsets[e + 1]).
    inv_perm : [M, top_k] int32 (out): the row of pair (t, j) in permuted; -1 when its expert is
        not on this rank (expert_map [num_experts] int32, -1 = elsewhere) or out of range.
    permuted : [M * top_k, H] of input's dtype (out): row inv_perm[t, j] = input[t]; rows past
        offsets[-1] are left as they were. One expert's row order is unspecified on CUDA.
    """
    _ops.moe_grouped_permute(input, topk_ids, num_experts, expert_map, permuted, expert_offsets,
                             inv_perm)


def moe_grouped_gemm(
    out: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    alpha: Optional[torch.Tensor] = None,
) -> None:
    """out[r] = alpha[e] * (a[r] @ weight[e]^T) for r in [offsets[e], offsets[e + 1]), one
    launch for all experts (CUDA: a CUTLASS ptr-array grouped GEMM, sm90a).

    a : [rows, K]; weight : [E, N, K]; out : [rows, N]; all contiguous. bf16 (or, on the CPU,
    fp32/fp16) with out of a's dtype and alpha None; or float8_e4m3fn with out bf16 and alpha [E]
    float32 (activation scale x expert weight scale). Rows past offsets[E] are not written.
    """
    _ops.moe_grouped_gemm(out, a, weight, expert_offsets, alpha)


def moe_grouped_unpermute(
    permuted: torch.Tensor,
    inv_perm: torch.Tensor,
    topk_weights: Optional[torch.Tensor],
    output: torch.Tensor,
) -> None:
    """output[t] = sum_j topk_weights[t, j] * permuted[inv_perm[t, j]] (pairs with -1 add
    nothing; topk_weights None: weight 1), float32 sum rounded once to output's dtype."""
    _ops.moe_grouped_unpermute(permuted, inv_perm, topk_weights, output)


def moe_grouped_gemm_available() -> bool:
    """Whether this build has the CUDA grouped expert GEMM (CUDA torch and CUTLASS headers)."""
    return bool(_C.with_cuda and _C.moe_grouped_gemm_available())


# ---- W4A16: 4-bit weights x 16-bit activations (GPTQ, AWQ, compressed-tensors) ----------------
def gptq_marlin_repack(
    b_q_weight: torch.Tensor, perm: Optional[torch.Tensor], size_k: int, size_n: int,
    num_bits: int,
) -> torch.Tensor:
    """GPTQ's qweight [size_k / 8, size_n] int32 (row k's code in bits 4 (k % 8) of word
    [k // 8, n]) -> pyorch's w4 tiles [size_n / 16, size_k * 2] int32 (the layout is in
    cuda/include/pyorch/w4a16.h; not Marlin's). perm [size_k] int32 (act-order): row perm[j]
    becomes row j, as vLLM's. num_bits must be 4. size_k a multiple of 64, size_n of 16.
    """
    return _ops.gptq_marlin_repack(b_q_weight, perm, size_k, size_n, num_bits)


def awq_marlin_repack(
    b_q_weight: torch.Tensor, size_k: int, size_n: int, num_bits: int
) -> torch.Tensor:
    """AWQ's qweight [size_k, size_n / 8] int32 (AutoAWQ's [0, 2, 4, 6, 1, 3, 5, 7] column
    interleave) -> pyorch's w4 tiles [size_n / 16, size_k * 2] int32. num_bits must be 4."""
    return _ops.awq_marlin_repack(b_q_weight, size_k, size_n, num_bits)


def gptq_marlin_gemm(
    a: torch.Tensor,
    c: Optional[torch.Tensor],
    b_q_weight: torch.Tensor,
    b_scales: torch.Tensor,
    b_zeros: Optional[torch.Tensor],
    perm: Optional[torch.Tensor],
    workspace: torch.Tensor,
    b_q_type: ScalarType,
    size_m: int,
    size_n: int,
    size_k: int,
) -> torch.Tensor:
    """out [size_m, size_n] = a [size_m, size_k] @ W (into c when given), W [size_k, size_n]
    dequantized from the repacked codes: W[k, n] = (q - z) * b_scales[k // group_size, n],
    rounded to a's dtype, fp32 accumulation rounded once.

    vLLM's gptq_marlin_gemm, simplified (same name and meaning of what is kept):
    - b_q_type: scalar_types.uint4b8 (z = 8, GPTQ symmetric, no b_zeros) or scalar_types.uint4
      (b_zeros required: [num_groups, size_n / 8] int32, column n in bits 4 (n % 8) of word
      n // 8, plain order, not Marlin's permuted one). Other types are refused.
    - b_scales: [num_groups, size_n] in a's dtype, plain layout (no marlin_permute_scales);
      group_size = size_k / num_groups, a multiple of 16 (32, 64, 128, or size_k: per-channel).
    - perm: act-order (a[:, perm] first). vLLM's g_idx argument is dropped: pyorch requires the
      sorted g_idx to be k // group_size (equal groups, as GPTQ writes them; the GPTQ layer
      checks it at load), so perm says everything.
    - No b_bias, global_scale, is_k_full, use_atomic_add, use_fp32_reduce, is_zp_float: the
      k-split always reduces in fp32, deterministically.
    - workspace: int32, >= ceil(size_n / 64) zeros (w4a16_make_workspace); calls leave it zero.
    - a: fp16/bf16 on CUDA (rows 16-byte aligned); the CPU kernel also takes float32 (scales
      then float32). On CUDA, size_m <= 64 runs pyorch's tensor-core kernel, larger size_m
      dequantizes in column chunks and calls cuBLAS.
    """
    return _ops.gptq_marlin_gemm(
        a, c, b_q_weight, b_scales, b_zeros, perm, workspace, b_q_type.id, size_m, size_n,
        size_k,
    )


def w4a16_make_workspace(size_n: int, device: torch.device) -> torch.Tensor:
    """The zeroed int32 workspace gptq_marlin_gemm needs for outputs of size_n columns."""
    return torch.zeros((size_n + 63) // 64, dtype=torch.int32, device=device)


@torch.library.register_fake("pyorch::gptq_marlin_repack")
def _gptq_marlin_repack_fake(
    b_q_weight: torch.Tensor, perm: Optional[torch.Tensor], size_k: int, size_n: int,
    num_bits: int,
) -> torch.Tensor:
    return b_q_weight.new_empty((size_n // 16, size_k * 2))


@torch.library.register_fake("pyorch::awq_marlin_repack")
def _awq_marlin_repack_fake(
    b_q_weight: torch.Tensor, size_k: int, size_n: int, num_bits: int
) -> torch.Tensor:
    return b_q_weight.new_empty((size_n // 16, size_k * 2))


@torch.library.register_fake("pyorch::gptq_marlin_gemm")
def _gptq_marlin_gemm_fake(
    a: torch.Tensor, c: Optional[torch.Tensor], b_q_weight: torch.Tensor,
    b_scales: torch.Tensor, b_zeros: Optional[torch.Tensor], perm: Optional[torch.Tensor],
    workspace: torch.Tensor, b_q_type: int, size_m: int, size_n: int, size_k: int,
) -> torch.Tensor:
    return a.new_empty((size_m, size_n))


# ---- sampling -----------------------------------------------------------------------------------
def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor,
                                indices: Optional[torch.Tensor] = None) -> None:
    """logits[r, t] = -inf where bit t % 32 of bitmask[r, t // 32] is 0 (structured output).

    Parameters
    ----------
    logits : [num_rows, vocab_size] float32/float16/bfloat16, last dimension contiguous.
    bitmask : [num_rows, ceil(vocab_size / 32)] int32 on the logits' device.
    indices : [k] int32 rows to mask (both tensors' row ids), or None for every row.
    """
    _ops.apply_token_bitmask_inplace(logits, bitmask, indices)


def random_sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor,
                              seeds: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(logits[r] / temperature[r]), in one pass over the logits.

    The exponential race: out[r] is the first index of the largest logits[r, j] / temperature[r]
    - log(-log(u)), u from Philox4x32-10 keyed by seeds[r] at counter j // 4 (word j % 4),
    centred on a 2^-23 grid (``pyorch/philox.h``); the CPU and CUDA kernels compute the same
    words and float32 expression. A row with temperature <= 0 is greedy (its argmax). NaN is the
    largest value, as for ``torch.argmax``.

    Parameters
    ----------
    logits : [num_rows, vocab_size] float32/float16/bfloat16, last dimension contiguous.
    temperature : [num_rows] float32.  seeds : [num_rows] int64 (the bits are the Philox key).

    Returns [num_rows] int64.
    """
    out = torch.empty(logits.shape[0] if logits.dim() > 0 else 0, dtype=torch.int64,
                      device=logits.device)
    _ops.random_sample_from_logits(out, logits, temperature, seeds)
    return out


# ---- quantization (vLLM's _custom_ops names and signatures) --------------------------------------
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def scaled_fp8_quant(
    input: torch.Tensor,
    scale: Optional[torch.Tensor] = None,
    num_token_padding: Optional[int] = None,
    scale_ub: Optional[torch.Tensor] = None,
    use_per_token_if_dynamic: bool = False,
    output: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes input [num_tokens, hidden] (fp32/fp16/bf16) to float8_e4m3fn.

    With `scale` ([1] float32) the quantization is static; without, the scale is computed:
    one for the tensor, or with use_per_token_if_dynamic one per row ([num_tokens, 1], each
    absmax capped at `scale_ub` when given). num_token_padding pads the output's rows (left
    unwritten). Returns (output, scale).
    """
    if input.dim() != 2:
        raise ValueError(f"scaled_fp8_quant: input must be 2-D, got {tuple(input.shape)}")
    shape = (max(num_token_padding or 0, input.shape[0]), input.shape[1])
    if output is None:
        output = torch.empty(shape, device=input.device, dtype=FP8_DTYPE)
    if scale is None:
        if use_per_token_if_dynamic:
            scale = torch.empty((input.shape[0], 1), device=input.device, dtype=torch.float32)
            _ops.dynamic_per_token_scaled_fp8_quant(output, input, scale, scale_ub)
        else:
            scale = torch.empty(1, device=input.device, dtype=torch.float32)
            _ops.dynamic_scaled_fp8_quant(output, input, scale)
    else:
        if scale.numel() != 1:
            raise ValueError(f"scaled_fp8_quant: a static scale has one value, got "
                             f"{tuple(scale.shape)}")
        _ops.static_scaled_fp8_quant(output, input, scale)
    return output, scale


def rms_norm_dynamic_per_token_quant(
    input: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    quant_dtype: torch.dtype,
    scale_ub: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm then per-token dynamic fp8 quantization of the normed rows (vLLM's op):
    returns (output [..., hidden] quant_dtype, scales [num_tokens, 1] float32). With `residual`,
    residual += input first (in place) and the norm is of the sum; input is not written. The
    normed row is rounded to input's dtype as rms_norm rounds it, so the result equals rms_norm
    (or fused_add_rms_norm) followed by scaled_fp8_quant(use_per_token_if_dynamic=True). Only
    float8_e4m3fn is supported as quant_dtype."""
    output = torch.empty_like(input, dtype=quant_dtype)
    hidden = input.shape[-1]
    scales = torch.empty((input.numel() // hidden if hidden else 0, 1), device=input.device,
                         dtype=torch.float32)
    _ops.rms_norm_dynamic_per_token_quant(output, input, weight, scales, epsilon, scale_ub,
                                          residual)
    return output, scales


def silu_and_mul_dynamic_per_token_quant(
    input: torch.Tensor,
    quant_dtype: torch.dtype = FP8_DTYPE,
    scale_ub: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up, then per-token dynamic fp8 quantization of those rows, in one op:
    input [..., 2 * d] (gate then up) -> (output [..., d] quant_dtype, scales [num_tokens, 1]
    float32, each row's absmax capped at `scale_ub` when given). The product is rounded to input's
    dtype as silu_and_mul rounds it, so the result equals silu_and_mul followed by
    scaled_fp8_quant(use_per_token_if_dynamic=True) bit for bit. Only float8_e4m3fn is supported
    as quant_dtype."""
    output = torch.empty((*input.shape[:-1], input.shape[-1] // 2), device=input.device,
                         dtype=quant_dtype)
    scales = torch.empty((math.prod(input.shape[:-1]), 1), device=input.device,
                         dtype=torch.float32)
    _ops.silu_and_mul_dynamic_per_token_quant(output, input, scales, scale_ub)
    return output, scales


def scaled_int8_quant(
    input: torch.Tensor,
    scale: Optional[torch.Tensor] = None,
    azp: Optional[torch.Tensor] = None,
    symmetric: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Quantizes input [..., hidden] to int8: static with `scale` [1] (and `azp` [1] int32 when
    asymmetric), else dynamic per token (scales [num_tokens, 1], azp [num_tokens, 1] int32 when
    not symmetric). Returns (output, scales, azp)."""
    output = torch.empty_like(input, dtype=torch.int8)
    if scale is not None:
        if symmetric != (azp is None):
            raise ValueError("scaled_int8_quant: a static azp is given exactly when asymmetric")
        _ops.static_scaled_int8_quant(output, input, scale, azp)
        return output, scale, azp
    num_tokens = input.numel() // input.shape[-1] if input.shape[-1] else 0
    scales = torch.empty((num_tokens, 1), device=input.device, dtype=torch.float32)
    input_azp = None if symmetric else torch.empty_like(scales, dtype=torch.int32)
    _ops.dynamic_scaled_int8_quant(output, input.contiguous(), scales, input_azp)
    return output, scales, input_azp


def per_token_group_quant_fp8(
    x: torch.Tensor,
    group_size: int,
    eps: float = 1e-10,
    dtype: Optional[torch.dtype] = None,
    column_major_scales: bool = False,
    out_q: Optional[torch.Tensor] = None,
    use_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes x [..., K] to fp8 in groups of group_size along K (the activations of a
    block-fp8 GEMM). Returns (x_q [..., K] float8_e4m3fn, x_s [..., K / group_size] float32);
    column_major_scales lays x_s out transposed in memory ([K / group_size, M] contiguous, seen
    as [M, K / group_size]), the layout the CUTLASS block GEMM reads."""
    dtype = dtype or FP8_DTYPE
    if dtype != FP8_DTYPE:
        raise ValueError(f"per_token_group_quant_fp8: only {FP8_DTYPE} is supported, got {dtype}")
    if x.shape[-1] % group_size:
        raise ValueError(f"per_token_group_quant_fp8: the last dimension {x.shape[-1]} is not a "
                         f"multiple of group_size {group_size}")
    x2 = x.reshape(-1, x.shape[-1])
    q = out_q if out_q is not None else torch.empty(x.shape, device=x.device, dtype=dtype)
    num_groups = x.shape[-1] // group_size
    if column_major_scales:
        s = torch.empty((num_groups, x2.shape[0]), device=x.device, dtype=torch.float32).t()
    else:
        s = torch.empty((x2.shape[0], num_groups), device=x.device, dtype=torch.float32)
    _ops.per_token_group_fp8_quant(x2, q.view(-1, x.shape[-1]), s, group_size, eps, -FP8_MAX,
                                   FP8_MAX, use_ue8m0)
    return q, (s if x.dim() == 2 else s.reshape(*x.shape[:-1], num_groups))


def cutlass_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(a [M, K] @ b [K, N]) * scale_a * scale_b (+ bias [N]) in out_dtype; a row-major, b
    column-major (a [N, K] weight's .t()), both float8_e4m3fn or both int8.

    scale_a: [1] or [M, 1] (per token); scale_b: [1] or [N] / [1, N] (per channel); or
    block-wise (fp8): scale_a [M, ceil(K/128)], scale_b [ceil(K/128), ceil(N/128)].
    """
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    _ops.cutlass_scaled_mm(out, a, b, scale_a, scale_b, bias)
    return out


def cutlass_scaled_mm_azp(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    azp_adj: torch.Tensor,
    azp: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """cutlass_scaled_mm for int8 with asymmetric activations: azp_adj [N] int32 is
    azp * colsum(b) for a per-tensor azp (azp None), or colsum(b) with a per-token azp [M]."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    _ops.cutlass_scaled_mm_azp(out, a, b, scale_a, scale_b, azp_adj, azp, bias)
    return out


def has_cuda_kernel(op_name: str) -> bool:
    """Whether torch.ops.pyorch.<op_name> has a CUDA kernel in this build (the CUTLASS GEMMs
    exist only where they were compiled)."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"pyorch::{op_name}", "CUDA"))

# ---- GGUF (vLLM's ggml ops; unlike the ops above they return their result, as vLLM's do) -------
def ggml_dequantize(
    W: torch.Tensor, quant_type: int, m: int, n: int, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """A GGUF tensor's blocks as floats: [m, n] of dtype (float16 when None, as vLLM).

    W holds the tensor's raw bytes as stored in the file (uint8 [m, n / block_size * type_size]),
    quant_type is its GGML type id (``gguf.GGMLQuantizationType``): F32, F16, BF16, Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K.
    """
    return _ops.ggml_dequantize(W, quant_type, m, n, dtype)


def ggml_mul_mat_vec_a8(
    W: torch.Tensor, X: torch.Tensor, quant_type: int, row: int
) -> torch.Tensor:
    """X @ W^T for few tokens (decode), read from W's quantized blocks: X [num_tokens, cols]
    fp32/fp16/bf16, W `row` rows of cols (as ggml_dequantize); returns [num_tokens, row] of X's
    dtype. X is quantized to 8 bits per 32 values (scale max|x| / 127) for integer dot products.
    Types: the quantized ones of ggml_dequantize (not F32/F16/BF16)."""
    return _ops.ggml_mul_mat_vec_a8(W, X, quant_type, row)


def ggml_mul_mat_a8(W: torch.Tensor, X: torch.Tensor, quant_type: int, row: int) -> torch.Tensor:
    """ggml_mul_mat_vec_a8 for many tokens (prefill): the same result, a kernel built for M > 8."""
    return _ops.ggml_mul_mat_a8(W, X, quant_type, row)


def ggml_mul_mat_repacked_a8(
    W: torch.Tensor, X: torch.Tensor, quant_type: int, row: int
) -> torch.Tensor:
    """ggml_mul_mat_a8 (any number of tokens) on the CPU from Q4_0 / Q4_1 / Q8_0 rows repacked in
    groups of 8 (``pyorch.layers.quantization.gguf.repack_blocks``; layout in cpp/cpu/gguf.cpp):
    the same result, one output row per SIMD lane. row must be a multiple of 8."""
    if not W.device.type == "cpu":
        raise ValueError(f"ggml_mul_mat_repacked_a8 is a CPU op (the repacked layout is the CPU "
                         f"kernels'); W is on {W.device}")
    return _ops.ggml_mul_mat_repacked_a8(W, X, quant_type, row)


def ggml_mul_mat_repacked_fused(
    out: torch.Tensor,
    X: torch.Tensor,
    W: torch.Tensor,
    quant_type: int,
    row: int,
    bias: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    eps: float,
    epilogue: str,
) -> None:
    """ggml_mul_mat_repacked_a8 with a decode layer's neighbours (pyorch/layers/fused_linear.py):
    y = X' @ W^T + bias with X' = RMSNorm(X) * norm_weight when norm_weight is given, else X;
    epilogue "store": out = y [T, row]; "add": out += y (the residual stream); "silu_and_mul":
    out = silu(y[:, :row / 2]) * y[:, row / 2:] [T, row / 2]. CPU only, like the layout."""
    if W.device.type != "cpu":
        raise ValueError(f"ggml_mul_mat_repacked_fused is a CPU op (the repacked layout is the "
                         f"CPU kernels'); W is on {W.device}")
    _ops.ggml_mul_mat_repacked_fused(out, X, W, quant_type, row, bias, norm_weight, eps, epilogue)


def ggml_mul_mat_vec_fused(
    out: torch.Tensor,
    X: torch.Tensor,
    W: torch.Tensor,
    quant_type: int,
    row: int,
    norm_weight: Optional[torch.Tensor],
    eps: float,
    input_op: str,
    epilogue: str,
) -> None:
    """ggml_mul_mat_vec_a8 with a decode layer's neighbours, W in the file's layout:
    y = f(X) @ W^T with f by input_op: "none" (X), "rms_norm" (rms_norm(X, norm_weight, eps)) or
    "silu_and_mul" (X [T, 2 * cols]: silu(X[:, :cols]) * X[:, cols:]); epilogue "store": out = y
    [T, row], "add": out += y (the residual stream). Each step rounds as its own op would. On CUDA
    one token of Q4_K is one kernel (the direct form, cuda/gguf/gguf_mmvq_q4k.cuh); other
    arguments, and the CPU, run the ops it fuses in turn. X, out (and norm_weight) contiguous,
    one dtype; out overlaps neither X nor norm_weight."""
    _ops.ggml_mul_mat_vec_fused(out, X, W, quant_type, row, norm_weight, eps, input_op, epilogue)


# ---- MoE decode pair and grouped top-k ----------------------------------------------------------
def fused_moe_decode(
    out: torch.Tensor,
    act: torch.Tensor,
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    block_size: int,
    pdl: Optional[bool] = None,
) -> None:
    """The MoE of a few tokens in two launches (gate_up with SiLU-and-mul; down with the routing
    weights and the sum over top_k), over moe_align_block_size's sort for block_size.

    out : [M, H] (out): sum_j topk_weights[t, j] * (act[t * top_k + j] @ w2[e]^T), fp32 sums.
    act : [M * top_k, I] (out): silu(x[t] @ gate_e^T) * (x[t] @ up_e^T), in the dtype.
    hidden_states : [M, H] (last dim contiguous). w13 : [E, 2I, H]. w2 : [E, H, I].
    topk_weights : [M, top_k] float32. Pairs of expert -1 (another rank's) add nothing.
    CUDA: float16/bfloat16, block_size 8 or 16, M <= 128; pdl None = the process default.
    """
    _ops.fused_moe_decode(
        out, act, hidden_states, w13, w2, topk_weights, sorted_token_ids, expert_ids,
        num_tokens_post_padded, block_size, pdl,
    )


def grouped_topk(
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gating_output: torch.Tensor,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> None:
    """vLLM's grouped_topk router (DeepSeek-V2/V3): scores = softmax or sigmoid of gating_output
    [M, E] in float32; the topk_group best of num_expert_group groups (group score: max, or the
    sum of the top two with e_score_correction_bias [E] float32 added), then the top_k experts of
    those groups (by score + bias; ties to the lower id). topk_weights [M, top_k] float32 (out) =
    their unbiased scores, renormalized when asked, times routed_scaling_factor; topk_ids
    [M, top_k] int32/int64 (out)."""
    _ops.grouped_topk(
        topk_weights, topk_ids, gating_output, num_expert_group, topk_group, renormalize,
        scoring_func, routed_scaling_factor, e_score_correction_bias,
    )
