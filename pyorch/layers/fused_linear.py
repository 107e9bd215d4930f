"""The decode-time linear layers with their neighbours fused in (pyorch::skinny_gemm_fused).

At decode batch sizes a linear layer is a stream of its weight, and the small kernels between
the GEMMs (RMSNorm, SiLU-and-mul, the residual add) cost a launch and a dependent round trip
each. A Llama decoder layer is then 6 kernels instead of 9:

    qkv = norm_linear(residual, input_layernorm, qkv_proj)          # RMSNorm + GEMM
    ... rotary + cache write, attention ...
    linear_add_(residual, attn_out, o_proj)                         # GEMM + residual add
    act = norm_linear(residual, post_attention_layernorm, gate_up_proj, "silu_and_mul")
    linear_add_(residual, act, down_proj)

The residual stream lives in one tensor that the adds update in place. The normed input is
rounded once (x * norm_weight) where RMSNorm then the GEMM round twice, so the results are close
to, not bit-equal with, the unfused layer, which tests compare it against (`FUSED_DECODE`).
fp8 layers (a quant method with `skinny_weight(layer)`: Fp8LinearMethod with per-tensor or
per-channel scales) take the same path through skinny_gemm_fp8, the same kernel streaming e4m3
weights, with their scale applied in the epilogue.
On the CPU, GGUF layers repacked for the 8-row kernels (pyorch/layers/quantization/gguf.py) take
the same path through ggml_mul_mat_repacked_fused, at every token count: the norm, the bias and
the epilogue run inside the op that quantizes the activation and streams the blocks, so a layer
is 6 ops instead of 10, with as many fewer Python calls (batch-1 decode of the default model,
bench/gguf_cpu.py: see bench/results/cpu/README.md).
On CUDA, with PYORCH_GGUF_FUSED_DECODE=1, GGUF layers of one Q4_K tensor each (a file's own
layout) take the path at one token through ggml_mul_mat_vec_fused, the direct Q4_K kernel with
the norm or SiLU-and-mul formed from its input and the residual add in its store: the MLP is
gate_up(norm(residual)) then residual += down(silu_and_mul(that)) (norm_mlp_add_), since the
direct kernel computes gate and up rows apart. It is off by default: on an H200 the fused chain
of 1024-thread kernels, none of which can start beside the one before it, measured slower than
the unfused layer, whose small norm kernels let each product start streaming early under PDL.
The fused GEMMs launch without PDL, o_proj included (on an H100 at batch 1, o_proj under PDL
after attention measured 5.91 / 5.91 ms/token against 5.90 / 5.88 without), and so without the
up-front L2 prefetch that PDL launches overlap with the previous kernel (5.77 / 5.78 without).
"""

from typing import Any, Optional, cast

import torch
from torch import nn

from pyorch import _ops, envs
from pyorch.layers.layernorm import RMSNorm
from pyorch.layers.linear import UnquantizedLinearMethod, use_skinny_gemm
from pyorch.layers.quantization.gguf import GGML_Q4_K
from pyorch.layers.quantization.utils.w8a8_utils import use_skinny_fp8

# The op overload itself: the packet's per-call overload resolution is skipped on the CPU GGUF
# decode path, where a step makes a few hundred of these calls (_gguf_one_shard).
_GGUF_FUSED = torch.ops.pyorch.ggml_mul_mat_repacked_fused.default

# Tests turn this off to compare the fused layer with the unfused one (batch-1 decode on an H100:
# 5.77-5.78 ms/token fused against 6.17 unfused, so there is no run-time switch).
FUSED_DECODE = True
# bf16 only: the normed input x * norm_weight is formed before the 1 / rms scale, and in fp16 a
# large residual-stream value times its weight could pass fp16's 65504.
_FUSED_DTYPES = (torch.bfloat16,)


def _weight_and_bias(layer: nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A linear layer's weight and bias parameters: registered at run time (create_weights,
    LinearBase._create_bias), where nn.Module's stubs type them as Tensor | Module."""
    return cast(torch.Tensor, layer.weight), cast(Optional[torch.Tensor], layer.bias)


def _fp8_weight(layer: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(weight [N, K] e4m3, weight_scale [1] or [N]) of a layer whose quant method streams
    through skinny_gemm_fp8 (its `skinny_weight`), else None."""
    skinny_weight = getattr(getattr(layer, "quant_method", None), "skinny_weight", None)
    return None if skinny_weight is None else skinny_weight(layer)


def _gguf_repacked(layer: nn.Module) -> Optional[list[Any]]:
    """The GGUF shards of a layer, when every one is in the CPU kernels' repacked layout
    (GGUFLinearMethod after process_weights_after_loading), else None. A merged layer whose
    files' types differ (a Q4_K_M file's Q4_K q/k and Q6_K v) keeps one shard per type."""
    shards = getattr(layer, "gguf_shards", None)
    if not shards or not all(getattr(s, "repacked", False) for s in shards):
        return None
    return cast(list[Any], shards)


def _gguf_one_shard(layer: nn.Module) -> Optional[tuple[Any, ...]]:
    """(data, ggml_type, rows, bias) of a layer whose GGUF weight is one repacked shard, else
    None; cached in the layer's __dict__ beside the shard list it was read from (a reload
    replaces that list). A CPU decode step makes ~4 of these calls per layer, and the attribute
    lookups behind the general path (Module.__getattr__ for the bias, the shard scan) were a
    tenth of a small model's step (the default model: 0.4 of ~5.3 ms at batch 1)."""
    shards = layer.__dict__.get("gguf_shards")
    cached = layer.__dict__.get("_gguf_one_shard")
    if cached is not None and cached[0] is shards:
        return cast(Optional[tuple[Any, ...]], cached[1])
    call = None
    if shards and len(shards) == 1 and getattr(shards[0], "repacked", False):
        s = shards[0]
        call = (s.data, s.ggml_type, s.rows, layer.bias)
    layer.__dict__["_gguf_one_shard"] = (shards, call)
    return call


def _gguf_fused(
    out: torch.Tensor, x: torch.Tensor, shards: list[Any], layer: nn.Module,
    norm: Optional[RMSNorm], epilogue: str,
) -> None:
    """ggml_mul_mat_repacked_fused over a layer's shards: each writes (or adds) its columns of
    out; SiLU-and-mul over shards of different types runs after them (its halves would straddle
    the shards)."""
    bias = cast(Optional[torch.Tensor], layer.bias)
    norm_weight = None if norm is None else norm.weight
    eps = 0.0 if norm is None else norm.variance_epsilon
    if len(shards) == 1:
        s = shards[0]
        _ops.ggml_mul_mat_repacked_fused(out, x, s.data, s.ggml_type, s.rows, bias, norm_weight,
                                         eps, epilogue)
        return
    if epilogue == "silu_and_mul":
        y = torch.empty(x.shape[0], 2 * out.shape[1], dtype=x.dtype, device=x.device)
        _gguf_fused(y, x, shards, layer, norm, "store")
        _ops.silu_and_mul(out, y)
        return
    offset = 0
    for s in shards:
        part_bias = None if bias is None else bias[offset:offset + s.rows]
        _ops.ggml_mul_mat_repacked_fused(out[:, offset:offset + s.rows], x, s.data, s.ggml_type,
                                         s.rows, part_bias, norm_weight, eps, epilogue)
        offset += s.rows


def _gguf_cuda_q4k(layer: nn.Module) -> Optional[Any]:
    """The one shard of a GGUF layer on CUDA whose weight is one Q4_K tensor in the file's
    layout, with no bias, else None: what ggml_mul_mat_vec_fused runs as one kernel (other
    types would run its ops in turn, more kernels than the unfused layer)."""
    shards = getattr(layer, "gguf_shards", None)
    if (not shards or len(shards) != 1 or getattr(layer, "bias", None) is not None
            or getattr(layer, "tp_size", 1) != 1):
        return None
    s = shards[0]
    if s.repacked or s.ggml_type != GGML_Q4_K or s.data.device.type != "cuda":
        return None
    return s


def skinny_fusable(layer: nn.Module, sharded_ok: bool = False) -> bool:
    """Whether a linear layer may run inside skinny_gemm_fused (or skinny_gemm_fp8 for an fp8
    layer): a weight in the skinny GEMM's layout, of one rank (a row-parallel layer needs its
    collective between the GEMM and the epilogue) unless sharded_ok (a column-parallel layer's
    epilogue is per column: gate_up's silu_and_mul under tensor parallelism; bf16/fp16 weights
    only, as linear_silu_and_mul streams those)."""
    weight = getattr(layer, "weight", None)
    bias = getattr(layer, "bias", None)
    if _gguf_repacked(layer) is not None:  # the CPU's GGUF path: one rank, one shard
        return (not sharded_ok and getattr(layer, "tp_size", 1) == 1
                and (bias is None or bias.is_contiguous()))
    if _gguf_cuda_q4k(layer) is not None:  # opt-in: see PYORCH_GGUF_FUSED_DECODE
        return not sharded_ok and envs.PYORCH_GGUF_FUSED_DECODE
    fp8 = _fp8_weight(layer)
    if fp8 is not None:
        if sharded_ok:
            return False
        weight_nk, scale = fp8
        return (
            getattr(layer, "tp_size", 1) == 1
            and weight_nk.is_contiguous()
            and weight_nk.data_ptr() % 16 == 0
            and weight_nk.shape[1] % 16 == 0
            and scale.dtype == torch.float32
            and scale.numel() in (1, weight_nk.shape[0])
            and (bias is None or (bias.dtype in _FUSED_DTYPES and bias.is_contiguous()))
        )
    return (
        isinstance(getattr(layer, "quant_method", None), UnquantizedLinearMethod)
        and (sharded_ok or getattr(layer, "tp_size", 1) == 1)
        and weight is not None
        and weight.dtype in _FUSED_DTYPES
        and weight.is_contiguous()
        and weight.data_ptr() % 16 == 0
        and weight.shape[1] % 8 == 0
        and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()))
    )


def fused_decode_batch(x: torch.Tensor, first_layer: nn.Module) -> bool:
    """Whether a batch x [num_tokens, input_size] takes the fused path (a decode batch on CUDA in
    the skinny GEMM's layout, or any batch on the CPU for repacked GGUF layers); whether the
    model's layers can is the caller's other half."""
    if _gguf_repacked(first_layer) is not None:
        return FUSED_DECODE and x.dim() == 2 and x.device.type == "cpu"
    if _gguf_cuda_q4k(first_layer) is not None:  # the direct Q4_K kernel: one token
        return (FUSED_DECODE and x.dim() == 2 and x.shape[0] == 1 and x.is_cuda
                and x.dtype in (torch.bfloat16, torch.float16, torch.float32))
    if not (FUSED_DECODE and x.dim() == 2 and x.dtype in _FUSED_DTYPES):
        return False
    fp8 = _fp8_weight(first_layer)
    if fp8 is not None:
        return x.is_cuda and use_skinny_fp8(x, fp8[0], fp8[1], _weight_and_bias(first_layer)[1])
    return use_skinny_gemm(x, *_weight_and_bias(first_layer))


def norm_linear(
    x: torch.Tensor,  # [T, input_size]: the residual stream, not normed
    norm: RMSNorm,
    layer: nn.Module,
    epilogue: str = "store",  # or "silu_and_mul" for a merged [gate; up] layer
) -> torch.Tensor:  # [T, output_size] ([T, output_size / 2] for silu_and_mul)
    """layer(norm(x)), then the epilogue, as one kernel."""
    one = _gguf_one_shard(layer)
    if one is not None:
        data, ggml_type, rows, bias = one
        out = torch.empty(x.shape[0], rows // 2 if epilogue == "silu_and_mul" else rows,
                          dtype=x.dtype, device=x.device)
        _GGUF_FUSED(out, x, data, ggml_type, rows, bias, norm.weight, norm.variance_epsilon,
                    epilogue)
        return out
    shards = _gguf_repacked(layer)
    if shards is not None:
        rows = sum(s.rows for s in shards) // (2 if epilogue == "silu_and_mul" else 1)
        out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
        _gguf_fused(out, x, shards, layer, norm, epilogue)
        return out
    shard = _gguf_cuda_q4k(layer)
    if shard is not None:
        y = torch.empty(x.shape[0], shard.rows, dtype=x.dtype, device=x.device)
        _ops.ggml_mul_mat_vec_fused(y, x, shard.data, shard.ggml_type, shard.rows, norm.weight,
                                    norm.variance_epsilon, "rms_norm", "store")
        if epilogue != "silu_and_mul":
            return y
        out = torch.empty(x.shape[0], shard.rows // 2, dtype=x.dtype, device=x.device)
        _ops.silu_and_mul(out, y)  # norm_mlp_add_ takes it into the down product instead
        return out
    weight, bias = _weight_and_bias(layer)
    fp8 = _fp8_weight(layer)
    if fp8 is not None:
        weight = fp8[0]
    cols = weight.shape[0] // (2 if epilogue == "silu_and_mul" else 1)
    out = torch.empty(x.shape[0], cols, dtype=x.dtype, device=x.device)
    if fp8 is not None:
        _ops.skinny_gemm_fp8(out, x, weight, fp8[1], bias, norm.weight, norm.variance_epsilon,
                             epilogue)
    else:
        _ops.skinny_gemm_fused(out, x, weight, bias, norm.weight, norm.variance_epsilon, epilogue)
    return out


def linear_add_(
    residual: torch.Tensor,  # [T, output_size], updated in place
    x: torch.Tensor,  # [T, input_size]
    layer: nn.Module,
) -> torch.Tensor:
    """residual += layer(x), as one kernel; returns residual."""
    one = _gguf_one_shard(layer)
    if one is not None:
        data, ggml_type, rows, bias = one
        _GGUF_FUSED(residual, x, data, ggml_type, rows, bias, None, 0.0, "add")
        return residual
    shards = _gguf_repacked(layer)
    if shards is not None:
        _gguf_fused(residual, x, shards, layer, None, "add")
        return residual
    shard = _gguf_cuda_q4k(layer)
    if shard is not None:
        _ops.ggml_mul_mat_vec_fused(residual, x.contiguous(), shard.data, shard.ggml_type,
                                    shard.rows, None, 0.0, "none", "add")
        return residual
    weight, bias = _weight_and_bias(layer)
    fp8 = _fp8_weight(layer)
    if fp8 is not None:
        _ops.skinny_gemm_fp8(residual, x, fp8[0], fp8[1], bias, None, 0.0, "add")
    else:
        _ops.skinny_gemm_fused(residual, x, weight, bias, None, 0.0, "add")
    return residual


def norm_mlp_add_(
    residual: torch.Tensor,  # [T, hidden], updated in place
    norm: RMSNorm,
    gate_up: nn.Module,  # merged [gate; up]
    down: nn.Module,
) -> torch.Tensor:
    """residual += down(silu_and_mul(gate_up(norm(residual)))), as two kernels: SiLU-and-mul in
    gate_up's epilogue, or (GGUF Q4_K on CUDA, whose kernel computes gate and up rows apart) in
    the down product's input. Returns residual."""
    shard = _gguf_cuda_q4k(down)
    if shard is not None and _gguf_cuda_q4k(gate_up) is not None:
        y = norm_linear(residual, norm, gate_up)  # [T, 2 * intermediate]
        _ops.ggml_mul_mat_vec_fused(residual, y, shard.data, shard.ggml_type, shard.rows, None,
                                    0.0, "silu_and_mul", "add")
        return residual
    return linear_add_(residual, norm_linear(residual, norm, gate_up, "silu_and_mul"), down)


def linear_silu_and_mul(
    x: torch.Tensor,  # [T, input_size]: already normed
    layer: nn.Module,  # a merged [gate; up] column-parallel layer (this rank's shard)
) -> torch.Tensor:  # [T, output_size / 2]
    """silu(gate) * up of layer(x), as one kernel (the tensor-parallel decode MLP: its norm
    comes from the fused all-reduce + RMSNorm before it)."""
    weight, bias = _weight_and_bias(layer)
    out = torch.empty(x.shape[0], weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    _ops.skinny_gemm_fused(out, x, weight, bias, None, 0.0, "silu_and_mul")
    return out
