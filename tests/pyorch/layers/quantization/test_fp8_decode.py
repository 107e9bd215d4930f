"""The decode path of the fp8 linear methods: up to 16 rows of bf16/fp16 activations go through
skinny_gemm_fp8 (W8A16: the activations unquantized, the e4m3 weight widened exactly), more rows
through the W8A8 path (per-token fp8 activations, cutlass_scaled_mm); and a Llama decode step
with fp8 layers runs the fused decoder layer (norm, SiLU-and-mul and residual add inside the fp8
GEMMs) close to the unfused one."""

from __future__ import annotations

import pytest
import torch

from pyorch import _ops
from pyorch.config import ModelConfig
from pyorch.forward_context import set_forward_context
from pyorch.layers.attention import Attention
from pyorch.layers.quantization.utils.w8a8_utils import FP8_SKINNY_MAX_TOKENS
from pyorch.model_loader import get_model
from tests.conftest import DEVICES, tol
from tests.pyorch.layers.quantization.checkpoints import tiny_model
from tests.pyorch.paged_batch import allocate_blocks, build_metadata
from tests.reference import gemm as ref
from tests.reference import quantization as qref

BLOCK_SIZE = 16
PROMPT_LENS = [5, 17, 1, 33]


def _model(tmp_path, arch: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    tiny_model(arch).save_pretrained(tmp_path)
    config = ModelConfig(model=str(tmp_path), dtype=dtype, device=device, quantization="fp8")
    config.resolve()
    return get_model(config)


def _w8a8_reference(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """Per-token fp8 activations (absmax / 448, e4m3 rounding) times the dequantized weight."""
    xs = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    xq = qref.f32(x.float() / xs).clamp(-448, 448).to(torch.float8_e4m3fn).double() * xs.double()
    w = layer.weight.t().double() * layer.weight_scale.double().reshape(-1, 1)
    return (xq @ w.T).to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, FP8_SKINNY_MAX_TOKENS, FP8_SKINNY_MAX_TOKENS + 1, 40])
def test_linear_w8a16_up_to_16_rows_w8a8_past(tmp_path, monkeypatch, device, dtype, num_tokens):
    model = _model(tmp_path, "llama", device, dtype)
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == torch.float8_e4m3fn
    calls = []
    real_op = _ops.skinny_gemm_fp8
    monkeypatch.setattr(_ops, "skinny_gemm_fp8",
                        lambda *a, **k: (calls.append(a), real_op(*a, **k)))
    x = (torch.randn(num_tokens, layer.weight.shape[0], device=device) * 2).to(dtype)
    with torch.no_grad():
        out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    if num_tokens <= FP8_SKINNY_MAX_TOKENS:
        assert len(calls) == 1
        w = layer.weight.t().double() * layer.weight_scale.double().reshape(-1, 1)
        torch.testing.assert_close(out, ref.linear(x, w, None), **tol(dtype))
    else:
        assert not calls
        # an fp8 rounding boundary crossed by a last-bit difference of the scale moves one product
        # by an e4m3 step: compare in bulk
        want = _w8a8_reference(x, layer).float()
        err = (out.float() - want).abs()
        assert err.mean() < 0.01 * want.abs().mean() and err.max() < 0.1 * want.abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_decode_with_fp8_layers_matches_unfused(tmp_path, monkeypatch, device):
    """A decode step of an online-fp8 Llama in bf16: the fused layers (skinny_gemm_fp8 with the
    norm, SiLU-and-mul and add epilogues, 4 calls per layer) against the unfused ones (the plain
    skinny_gemm_fp8 after separate norm / activation kernels). On the CPU the fused path is let in
    by widening its batch check to CPU tensors (the CPU op is the same contract)."""
    from pyorch.layers import fused_linear
    from pyorch.models import llama

    dtype = torch.bfloat16
    model = _model(tmp_path, "llama", device, dtype).eval()
    if device == "cpu":
        monkeypatch.setattr(llama, "fused_decode_batch",
                            lambda x, layer: fused_linear.FUSED_DECODE and 0 < x.shape[0] <= 16)
    fused_calls = []
    real_op = _ops.skinny_gemm_fp8

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        # skinny_gemm_fp8(out, input, weight, weight_scale, bias, norm_weight, epsilon, epilogue)
        fused = (len(args) > 5 and args[5] is not None) or (len(args) > 7 and args[7] != "store")
        if fused:
            fused_calls.append(args)
        return real_op(*args, **kwargs)

    monkeypatch.setattr(_ops, "skinny_gemm_fp8", counted)
    attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
    tables, num_blocks = allocate_blocks([n + 1 for n in PROMPT_LENS], BLOCK_SIZE)
    for layer in attn_layers:
        shape = (num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size)
        layer.kv_cache = (torch.zeros(shape, dtype=dtype, device=device),
                          torch.zeros(shape, dtype=dtype, device=device))
    gen = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size if hasattr(model, "config") else 512
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    meta, positions = build_metadata([0] * len(prompts), PROMPT_LENS, tables, BLOCK_SIZE, device)
    with torch.no_grad(), set_forward_context(meta):
        model(torch.tensor(sum(prompts, []), device=device), positions)
    assert not fused_calls
    next_ids = torch.randint(0, vocab, (len(prompts),), generator=gen).tolist()
    meta, positions = build_metadata(PROMPT_LENS, [1] * len(prompts), tables, BLOCK_SIZE, device)

    def decode() -> torch.Tensor:
        with torch.no_grad(), set_forward_context(meta):
            return model.compute_logits(model(torch.tensor(next_ids, device=device), positions))

    fused = decode()
    num_layers = len(attn_layers)
    assert len(fused_calls) == 4 * num_layers
    monkeypatch.setattr(fused_linear, "FUSED_DECODE", False)
    unfused = decode()
    assert len(fused_calls) == 4 * num_layers
    # The fused layer rounds the normed input once where the unfused one rounds twice (bf16).
    scale = unfused.abs().max().item()
    assert (fused - unfused).abs().max().item() < 0.05 * scale
    assert (fused.argmax(-1) == unfused.argmax(-1)).float().mean() >= 0.75


def _fp8_model(tmp_path, arch: str, source: str, device: str,
               dtype: torch.dtype) -> torch.nn.Module:
    """A tiny fp8 model: online fp8, or a compressed-tensors W8A8-FP8 checkpoint with dynamic
    per-token activations (ct_token_dynamic) or static per-tensor ones (ct_tensor_static)."""
    from tests.pyorch.layers.quantization.checkpoints import write_compressed_tensors

    if source == "online":
        return _model(tmp_path, arch, device, dtype).eval()
    w_strategy, a_strategy, dynamic = (("channel", "token", True) if source == "ct_token_dynamic"
                                       else ("tensor", "tensor", False))
    path = write_compressed_tensors(str(tmp_path), arch, "fp8", w_strategy, a_strategy, dynamic)
    config = ModelConfig(model=path, dtype=dtype, device=device)
    config.resolve()
    return get_model(config).eval()


def _prefill_logits(model: torch.nn.Module, device: str, dtype: torch.dtype) -> torch.Tensor:
    """The logits of a prefill of two prompts (13 + 29 rows: past FP8_SKINNY_MAX_TOKENS)."""
    attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
    lens = [13, 29]
    tables, num_blocks = allocate_blocks(lens, BLOCK_SIZE)
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size if hasattr(model, "config") else 512
    ids = torch.randint(0, vocab, (sum(lens),), generator=gen).tolist()
    for layer in attn_layers:
        shape = (num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size)
        layer.kv_cache = (torch.zeros(shape, dtype=dtype, device=device),
                          torch.zeros(shape, dtype=dtype, device=device))
    meta, positions = build_metadata([0, 0], lens, tables, BLOCK_SIZE, device)
    with torch.no_grad(), set_forward_context(meta):
        return model.compute_logits(model(torch.tensor(ids, device=device), positions))


def _count_calls(monkeypatch, name: str) -> list:
    calls: list = []
    real_op = getattr(_ops, name)
    monkeypatch.setattr(_ops, name, lambda *a, **k: (calls.append(a), real_op(*a, **k))[1])
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch,source,per_layer", [
    ("llama", "online", 2), ("qwen3", "online", 2), ("qwen3_moe", "online", 1),
    ("llama", "ct_token_dynamic", 2), ("llama", "ct_tensor_static", 0)])
def test_prefill_norms_quantize_for_the_fp8_linears(tmp_path, monkeypatch, device, arch, source,
                                                    per_layer):
    """A prefill of an fp8 model (more than FP8_SKINNY_MAX_TOKENS rows): the norms in front of
    qkv_proj and a dense MLP's gate_up_proj (not a mixture-of-experts block's router) quantize
    their output for the W8A8 GEMM in the same op (rms_norm_dynamic_per_token_quant) instead of a
    separate per-token quantization, and the logits equal the unfused path's bit for bit. Online
    fp8 and compressed-tensors W8A8-FP8 with dynamic per-token activations do; a static input
    scale does not (the linear quantizes with its own scale)."""
    from pyorch.layers.quantization.utils import w8a8_utils

    dtype = torch.bfloat16
    model = _fp8_model(tmp_path, arch, source, device, dtype)
    calls = _count_calls(monkeypatch, "rms_norm_dynamic_per_token_quant")
    num_layers = sum(isinstance(m, Attention) for m in model.modules())
    fused = _prefill_logits(model, device, dtype)
    assert len(calls) == per_layer * num_layers
    monkeypatch.setattr(w8a8_utils, "FUSED_NORM_QUANT", False)
    calls.clear()
    unfused = _prefill_logits(model, device, dtype)
    assert not calls
    torch.testing.assert_close(fused, unfused, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch,source,per_layer", [
    ("llama", "online", 1), ("qwen3", "online", 1), ("qwen3_moe", "online", 0),
    ("llama", "ct_token_dynamic", 1), ("llama", "ct_tensor_static", 0)])
def test_prefill_mlp_quantizes_for_the_fp8_down_proj(tmp_path, monkeypatch, device, arch, source,
                                                     per_layer):
    """A prefill of an fp8 model: a dense MLP's SiLU-and-mul quantizes its output for down_proj's
    W8A8 GEMM in the same op (silu_and_mul_dynamic_per_token_quant) instead of down_proj's own
    per-token quantization, whether gate_up_proj's input came quantized from the norm or not, and
    the logits equal the unfused path's bit for bit. Not in a mixture-of-experts block's experts
    (qwen3_moe), not for a static input scale."""
    from pyorch.layers.quantization.utils import w8a8_utils

    dtype = torch.bfloat16
    model = _fp8_model(tmp_path, arch, source, device, dtype)
    calls = _count_calls(monkeypatch, "silu_and_mul_dynamic_per_token_quant")
    num_layers = sum(isinstance(m, Attention) for m in model.modules())
    fused = _prefill_logits(model, device, dtype)
    assert len(calls) == per_layer * num_layers
    if per_layer:  # the rows it quantized: the prefill's, gate then up
        assert calls[0][0].shape == (13 + 29, 2 * model.model.layers[0].mlp.down_proj.input_size)
    # The MLP's input unquantized (gate_up_proj quantizes it): the activation still fuses.
    monkeypatch.setattr(w8a8_utils, "FUSED_NORM_QUANT", False)
    calls.clear()
    torch.testing.assert_close(_prefill_logits(model, device, dtype), fused, atol=0, rtol=0)
    assert len(calls) == per_layer * num_layers
    monkeypatch.setattr(w8a8_utils, "FUSED_NORM_QUANT", True)
    monkeypatch.setattr(w8a8_utils, "FUSED_ACT_QUANT", False)
    calls.clear()
    unfused = _prefill_logits(model, device, dtype)
    assert not calls
    torch.testing.assert_close(fused, unfused, atol=0, rtol=0)
