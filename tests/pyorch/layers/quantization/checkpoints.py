"""Tiny random quantized checkpoints written by their producers: compressed-tensors' own
quantization lifecycle and ModelCompressor (W8A8 fp8 / int8, static or dynamic activations),
and HF block-fp8 (`quant_method: fp8`, `weight_block_size`), plus the float model each one
dequantizes to (the reference the engine's output is compared with)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=1024, initializer_range=0.1, rms_norm_eps=1e-6,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    if arch == "llama":
        return transformers.LlamaConfig(**COMMON)
    if arch == "qwen3":
        return transformers.Qwen3Config(**COMMON)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=128, norm_topk_prob=True)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, num_hidden_layers: int | None = None) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(arch)
    if num_hidden_layers is not None:
        config.num_hidden_layers = num_hidden_layers
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger than HF's init so that greedy choices are decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith(".gate.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def _calibration_ids(vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab_size, (4, 24), generator=g)


def write_compressed_tensors(
    path: str, arch: str, kind: str, weight_strategy: str, act_strategy: str, dynamic: bool,
    symmetric_acts: bool = True, ignore: list[str] | None = None,
) -> str:
    """Quantizes a tiny model with compressed-tensors (kind "fp8" -> float-quantized, "int8" ->
    int-quantized) and saves it compressed, as llm-compressor does: qparams from the package's
    calculate_qparams over the weights and (static activations) a calibration forward."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_model(arch)
    qtype = "float" if kind == "fp8" else "int"
    weights = QuantizationArgs(num_bits=8, type=qtype, strategy=weight_strategy, symmetric=True,
                               dynamic=False)
    acts = QuantizationArgs(num_bits=8, type=qtype, strategy=act_strategy,
                            symmetric=symmetric_acts, dynamic=dynamic)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights,
                                                     input_activations=acts)},
        ignore=["lm_head", *(ignore or [])], quantization_status=QuantizationStatus.INITIALIZED)
    # Static activation ranges come from a calibration forward of the float model (before the
    # quantization wrappers exist, so nothing is quantized yet).
    act_ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if not dynamic:
        def observe(name: str):
            def hook(module: Any, args: tuple) -> None:
                x = args[0].detach()
                lo, hi = x.min().reshape(1), x.max().reshape(1)
                if name in act_ranges:
                    lo = torch.minimum(lo, act_ranges[name][0])
                    hi = torch.maximum(hi, act_ranges[name][1])
                act_ranges[name] = (lo, hi)
            return hook
        hooks = [m.register_forward_pre_hook(observe(n)) for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():
            model(_calibration_ids(model.config.vocab_size))
        for h in hooks:
            h.remove()
    apply_quantization_config(model, config)
    quantized = {n: m for n, m in model.named_modules() if hasattr(m, "weight_scale")}
    with torch.no_grad():
        for name, module in quantized.items():
            w = module.weight
            dims = (1,) if weight_strategy == "channel" else (0, 1)
            lo = w.amin(dim=dims, keepdim=weight_strategy == "channel").reshape(
                module.weight_scale.shape)
            hi = w.amax(dim=dims, keepdim=weight_strategy == "channel").reshape(
                module.weight_scale.shape)
            scale, zp = calculate_qparams(lo, hi, weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.copy_(zp.reshape(module.weight_zero_point.shape))
            if not dynamic:
                lo, hi = act_ranges[name]
                scale, zp = calculate_qparams(lo, hi, acts)
                module.input_scale.copy_(scale.reshape(module.input_scale.shape))
                module.input_zero_point.copy_(zp.reshape(module.input_zero_point.shape))
    fmt = "float-quantized" if kind == "fp8" else "int-quantized"
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def write_block_fp8(path: str, arch: str) -> str:
    """An HF fp8 checkpoint with 128 x 128 weight blocks (DeepSeek-V3 / Qwen3-FP8 layout):
    each linear weight as float8_e4m3fn with `weight_scale_inv` [ceil(N/128), ceil(K/128)]
    = the block's absmax / 448, as those checkpoints' quantizer writes it."""
    model = tiny_model(arch)
    model.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("proj.weight") and t.dim() == 2 and "mlp.gate." not in name:
            n, k = t.shape
            nb, kb = -(-n // 128), -(-k // 128)
            padded = torch.zeros(nb * 128, kb * 128)
            padded[:n, :k] = t.float()
            blocks = padded.reshape(nb, 128, kb, 128)
            scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[name] = q.reshape(nb * 128, kb * 128)[:n, :k].contiguous()
            out[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
        else:
            out[name] = t
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": [128, 128]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path
