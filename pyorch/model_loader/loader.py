"""Build a model and load its weights: ``get_model(model_config)``.

``model_config`` is ``pyorch.config.ModelConfig`` (read by duck typing: ``model``, ``hf_config``,
``dtype``, ``device``, ``load_format``, ``seed``, ``revision``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pyorch.layers.quantization import QuantizeMethodBase, online_weights_on_meta
from pyorch.model_loader.config import is_gguf
from pyorch.model_loader.gguf_loader import iterate_gguf_weights
from pyorch.model_loader.layerwise import PROCESSED_ATTR, LayerwiseQuantizer
from pyorch.model_loader.quant_config import get_quant_config
from pyorch.model_loader.weight_utils import (
    dummy_filler,
    initialize_dummy_weights,
    iterate_pt_weights,
    iterate_safetensors_weights,
    load_kv_scales,  # fp8 KV-cache scales
    pt_files,
    safetensors_files,
)

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _config_dtype(hf_config: Any) -> torch.dtype:
    """The checkpoint dtype a config declares (``dtype``, or v4's ``torch_dtype``); float32 when
    it declares none, as in transformers."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = _DTYPE_NAMES.get(value.removeprefix("torch."))
    return value if value in SUPPORTED_DTYPES else torch.float32


def _gpu_supports_bf16(device: torch.device) -> bool:
    return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()


def resolve_dtype(
    hf_config: Any, dtype: str | torch.dtype, device: str | torch.device
) -> torch.dtype:
    """The dtype to run the model in.

    Rules for ``"auto"`` (vLLM's, plus a CPU rule of ours):

    * GPU: a float32 checkpoint (or one that declares no dtype) runs in bfloat16, or float16 on a
      GPU without bfloat16; float16 and bfloat16 checkpoints keep their dtype (bfloat16 falls back
      to float16 on a GPU without bfloat16).
    * CPU: float32 and bfloat16 checkpoints keep their dtype; a float16 checkpoint runs in
      bfloat16, because torch's CPU kernels cover bfloat16 far better than float16 (vLLM's CPU
      backend makes the same cast). GGUF configs declare float32, so GGUF runs in float32 on CPU.

    An explicit dtype (``"float16"``/``"half"``, ``"bfloat16"``, ``"float32"``/``"float"``, or a
    ``torch.dtype``) is used as given.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported dtype {dtype}; use one of {SUPPORTED_DTYPES}")
        return dtype
    name = dtype.lower().removeprefix("torch.")
    if name != "auto":
        if name not in _DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(_DTYPE_NAMES)}")
        return _DTYPE_NAMES[name]
    config_dtype = _config_dtype(hf_config)
    device = torch.device(device)
    if device.type == "cpu":
        return torch.bfloat16 if config_dtype == torch.float16 else config_dtype
    if config_dtype == torch.float32:
        return torch.bfloat16 if _gpu_supports_bf16(device) else torch.float16
    if config_dtype == torch.bfloat16 and not _gpu_supports_bf16(device):
        return torch.float16
    return config_dtype


def resolve_load_format(model: str, load_format: str = "auto") -> str:
    """The concrete format for ``model``: 'gguf' for a .gguf file, else 'safetensors' when the
    directory has any, else 'pt' (``*.bin``); 'dummy' and explicit formats pass through."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {LOAD_FORMATS}")
    if load_format == "gguf" and not is_gguf(model):
        raise ValueError(f"load_format 'gguf' needs a .gguf file, got {model}")
    if load_format != "auto":
        return load_format
    if is_gguf(model):
        return "gguf"
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model directory not found: {model}")
    if safetensors_files(model):
        return "safetensors"
    if pt_files(model):
        return "pt"
    raise FileNotFoundError(f"{model}: no weights (*.safetensors, *.bin) in this directory")


def _local_model_dir(model: str, revision: str | None) -> str:
    """``model`` itself when it exists locally, else a hub snapshot of its weights and configs."""
    if os.path.exists(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model, revision=revision, allow_patterns=_HUB_PATTERNS)


_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt"]


def hub_snapshot(model: str, revision: str | None, cache_dir: str) -> str:
    """The local folder of hub model ``model`` in ``cache_dir``, downloaded there if missing
    (its configs, tokenizer files and weights); offline, what that folder already holds."""
    from huggingface_hub import snapshot_download

    try:
        return str(snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                     allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # offline and not in the folder, unknown repo, ...
        raise FileNotFoundError(f"model {model!r} is neither a local path nor available from "
                                f"the hub into --download-dir {cache_dir}: {e}") from None


def get_weights_iterator(
    model: str, load_format: str = "auto", revision: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Lazily yield (Hugging Face name, CPU tensor) for every weight of ``model``."""
    if load_format == "dummy":
        raise ValueError("load_format 'dummy' has no weights to iterate")
    if not is_gguf(model):
        model = _local_model_dir(model, revision)
    load_format = resolve_load_format(model, load_format)
    if load_format == "gguf":
        return iterate_gguf_weights(model)
    if load_format == "safetensors":
        return iterate_safetensors_weights(model)
    return iterate_pt_weights(model)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _resolve_model_class(architectures: list[str]) -> type:
    from pyorch.models.registry import resolve_model_class

    return resolve_model_class(architectures)


def get_model(model_config: Any) -> nn.Module:
    """Build ``model_config``'s model on its device in its dtype and load its weights.

    The class comes from ``pyorch.models.registry.resolve_model_class(hf_config.architectures)``
    and is built under ``torch.device(model_config.device)`` with the default dtype set to
    ``model_config.dtype`` (a ``torch.dtype``; a string is resolved with :func:`resolve_dtype`).
    Weights come from the file(s) named by ``model_config.model`` in ``load_format`` ('auto',
    'safetensors', 'pt', 'gguf'), or are random for 'dummy' (seeded by ``model_config.seed``).

    Returns
    -------
    torch.nn.Module
        In eval mode, on ``model_config.device``.
    """
    hf_config = model_config.hf_config
    device = torch.device(getattr(model_config, "device", "cpu") or "cpu")
    dtype = model_config.dtype
    if not isinstance(dtype, torch.dtype):
        dtype = resolve_dtype(hf_config, dtype or "auto", device)
    load_format = getattr(model_config, "load_format", "auto") or "auto"
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {LOAD_FORMATS}")
    model_cls = _resolve_model_class(list(getattr(hf_config, "architectures", None) or []))
    quant_config = get_quant_config(model_config)
    # Float weights that are quantized at load start on the meta device (layerwise.py).
    with _default_dtype(dtype), device, online_weights_on_meta():
        model = model_cls(hf_config, quant_config=quant_config) if quant_config else \
            model_cls(hf_config)
    layerwise = LayerwiseQuantizer(model, device)
    if layerwise and device.type == "cuda":  # the load's peak, logged below
        torch.cuda.reset_peak_memory_stats(device)
    if load_format == "dummy":
        seed = getattr(model_config, "seed", None)
        seed = 0 if seed is None else seed
        initialize_dummy_weights(model, seed=seed)
        with torch.no_grad():  # a stream of its own, not a replay of the one above
            layerwise.fill_dummy(dummy_filler(seed=seed + 1))
    else:
        weights = get_weights_iterator(
            model_config.model, load_format, getattr(model_config, "revision", None)
        )
        with torch.no_grad():
            # KV-cache scales go to the Attention layers, the rest to the model's loader.
            model.load_weights(load_kv_scales(model, weights))
            layerwise.finish()
    with torch.no_grad():
        process_weights_after_loading(model)
    if layerwise:
        _log_layerwise(layerwise, device)
    return model.eval()


def _log_layerwise(layerwise: LayerwiseQuantizer, device: torch.device) -> None:
    mib = 1 << 20
    peak = ""
    if device.type == "cuda":
        peak = (f"; device memory {torch.cuda.memory_allocated(device) / mib:,.0f} MiB after "
                f"loading, peak {torch.cuda.max_memory_allocated(device) / mib:,.0f} MiB")
    logger.info("Quantized %d layers as their weights loaded: at most %.1f MiB of float weights "
                "in memory at once%s", len(layerwise.layers), layerwise.peak_float_bytes / mib,
                peak)


def process_weights_after_loading(model: nn.Module) -> None:
    """Lets every module's quantization method repack its weights once all are loaded
    (quantize online, fold merged per-tensor scales, transpose for a kernel, ...). Modules the
    layerwise loader already processed are skipped."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase) and not getattr(module, PROCESSED_ATTR, False):
            method.process_weights_after_loading(module)
