"""Which quantization method a model runs with, and its config object (vLLM's
`ModelConfig._verify_quantization` and `get_quant_config`).

The method comes from the checkpoint's `quantization_config` (config.json) or from the user's
`quantization=` / `--quantization`; when both are given they must agree (after the methods'
`override_quantization_method`, e.g. a faster kernel for the same checkpoint format).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pyorch.layers.quantization import (
    QuantizationConfig,
    get_quantization_config,
    get_quantization_methods,
)

# Checkpoint spellings of method names -> the registry's.
_ALIASES = {"compressed_tensors": "compressed-tensors"}


def hf_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's quantization_config as a dict (None when it has none)."""
    cfg = getattr(hf_config, "quantization_config", None)
    if cfg is None:
        return None
    if not isinstance(cfg, dict):  # a transformers QuantizationConfigMixin
        cfg = cfg.to_dict()
    return dict(cfg)


def resolve_quantization(hf_config: Any, quantization: str | None) -> str | None:
    """The method name the model runs with; ValueError for an unknown name or for a
    `quantization` argument that contradicts the checkpoint's."""
    if quantization is not None:
        quantization = _ALIASES.get(quantization.lower(), quantization.lower())
        get_quantization_config(quantization)  # unknown names raise, listing the known ones
    checkpoint_cfg = hf_quant_config(hf_config)
    if checkpoint_cfg is None:
        return quantization
    raw = str(checkpoint_cfg.get("quant_method", "")).lower()
    if not raw:
        raise ValueError("the checkpoint's quantization_config names no quant_method")
    method = _ALIASES.get(raw, raw)
    for name in get_quantization_methods():
        override = get_quantization_config(name).override_quantization_method(
            checkpoint_cfg, quantization)
        if override is not None:
            method = override
            break
    if method not in get_quantization_methods():
        raise ValueError(f"the checkpoint is quantized with {raw!r}, which pyorch does not "
                         f"support. Known methods: {', '.join(get_quantization_methods())}")
    if quantization is not None and quantization != method:
        raise ValueError(
            f"Quantization method specified in the model config ({method}) does not match the "
            f"quantization method specified in the `quantization` argument ({quantization}).")
    return method


def get_quant_config(model_config: Any) -> QuantizationConfig | None:
    """The model's QuantizationConfig (None when it is not quantized): from the checkpoint's
    quantization_config, else from one of the method's own config files in the model folder,
    else the method's defaults (online quantization of a float checkpoint, e.g. fp8)."""
    name = getattr(model_config, "quantization", None)
    if name is None:
        return None
    cls = get_quantization_config(name)
    checkpoint_cfg = hf_quant_config(model_config.hf_config)
    if checkpoint_cfg is not None:
        config = cls.from_config(checkpoint_cfg)
    elif not cls.get_config_filenames():
        config = cls()
    else:
        config = cls.from_config(_read_config_file(model_config.model, cls))
    _check_platform(config, model_config)
    return config


def _read_config_file(model: str, cls: type[QuantizationConfig]) -> dict[str, Any]:
    import json

    folder = model if os.path.isdir(model) else os.path.dirname(model)
    for filename in cls.get_config_filenames():
        path = os.path.join(folder, filename)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict):
                raise ValueError(f"{path}: expected a JSON object")
            return data
    raise ValueError(f"Cannot find the config file for {cls.get_name()} in {folder} "
                     f"(looked for {', '.join(cls.get_config_filenames())})")


def _check_platform(config: QuantizationConfig, model_config: Any) -> None:
    dtype = model_config.dtype
    if isinstance(dtype, torch.dtype) and dtype not in config.get_supported_act_dtypes():
        raise ValueError(f"{config.get_name()} quantization does not support dtype {dtype}; "
                         f"supported: {config.get_supported_act_dtypes()}")
    device = torch.device(getattr(model_config, "device", "cpu") or "cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        if major * 10 + minor < config.get_min_capability():
            raise ValueError(
                f"{config.get_name()} quantization needs compute capability >= "
                f"{config.get_min_capability()}; this GPU has {major * 10 + minor}")
