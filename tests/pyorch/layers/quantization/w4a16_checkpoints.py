"""Tiny GPTQ / AWQ checkpoints, written in the exact on-disk formats (tests/reference/w4a16.py),
and the float reference model they dequantize to.

`write_w4a16_checkpoint` builds a random transformers model, quantizes every linear layer of its
decoder blocks (round to nearest; act-order's permuted groups for "gptq_act_order"), saves the
quantized tensors with a config.json carrying the method's quantization_config (the keys
AutoGPTQ / AutoAWQ write), and returns the same transformers model with each quantized weight
replaced by its float dequantization: the reference the engine must match token for token.
"""

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PretrainedConfig

from tests.reference import w4a16 as ref

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = ("gptq", "gptq_act_order", "awq")


def quantization_config(fmt: str, group_size: int) -> dict[str, Any]:
    if fmt == "awq":  # AutoAWQ's quant_config as transformers saves it
        return {"quant_method": "awq", "bits": 4, "group_size": group_size,
                "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size,
            "desc_act": fmt == "gptq_act_order", "sym": True, "checkpoint_format": "gptq",
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False}


def write_w4a16_checkpoint(
    path: str, config: PretrainedConfig, fmt: str, group_size: int, seed: int = 0,
    bf16_scales: bool = False,
) -> torch.nn.Module:
    """Writes the checkpoint to `path`; returns the dequantized float32 reference model.
    bf16_scales: scales that bf16 holds exactly (stored as float16 still), so that a bf16 engine
    forms exactly the reference's weights rounded to bf16."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.08)
    gen = torch.Generator().manual_seed(seed + 1)
    tensors: dict[str, torch.Tensor] = {}
    # GPTQ's act-order comes from the layer input's Hessian: projections that share an input
    # (q/k/v, gate/up) share their order. One order per input here, as GPTQ writes them.
    orders: dict[tuple[str, int], torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and module.endswith(LINEAR_SUFFIXES)):
            tensors[name] = tensor.clone()
            continue
        shared_input = module.rsplit(".", 1)[0] + (
            ".o" if module.endswith("o_proj") else ".down" if module.endswith("down_proj")
            else ".in")
        order = None
        if fmt == "gptq_act_order":
            k = tensor.shape[1]
            order = orders.setdefault((shared_input, k), torch.randperm(k, generator=gen))
        q = ref.quantize(tensor, group_size, sym=fmt != "awq", order=order)
        if bf16_scales:
            q.scales = q.scales.to(torch.bfloat16).to(torch.float16)
        parts = ref.awq_tensors(q) if fmt == "awq" else ref.gptq_tensors(
            q, act_order=fmt == "gptq_act_order")
        for key, value in parts.items():
            tensors[f"{module}.{key}"] = value.contiguous()
        with torch.no_grad():  # the reference holds the dequantized weight
            tensor.copy_(q.dequantize().t().to(tensor.dtype))
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    data = config.to_dict()
    data["architectures"] = [type(model).__name__]
    data["quantization_config"] = quantization_config(fmt, group_size)
    data["torch_dtype"] = "float16"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(data, f, indent=1)
    return model.eval()
