"""The quantization interface (vLLM's shape) and the registry of quantization methods.

A `QuantizationConfig` is parsed from a checkpoint's `quantization_config` (or built for
`quantization=` on a float checkpoint) and hands each layer its `QuantizeMethodBase`
(`get_quant_method(layer, prefix)`): the method creates the layer's parameters, is handed the
checkpoint tensors through their weight loaders, repacks them once in
`process_weights_after_loading`, and computes with them in `apply`. bf16 is
`UnquantizedLinearMethod` (pyorch/layers/linear.py), one method among them.

Registry: a method's module in this package registers its config with one line,

    @register_quantization_config("fp8")
    class Fp8Config(QuantizationConfig): ...

and every module here is imported the first time a name is looked up, so nothing else needs
editing. `get_quantization_config(name)` returns the class; `QUANTIZATION_METHODS` lists the names.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch import nn


class QuantizeMethodBase(ABC):
    """How one layer creates its (possibly quantized) weights and computes with them."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
        """Registers the layer's parameters (weights, scales, zero points) on `layer`."""

    @abstractmethod
    def apply(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Runs the layer's computation with the parameters made by create_weights."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repacks weights once every shard is loaded (e.g. for a kernel's layout). No-op here."""
        return None


# Online quantization (a float checkpoint quantized at load, `quantization="fp8"`): while the
# model loader builds a model under `online_weights_on_meta()`, methods create the float weights
# they will quantize on the meta device; the loader materializes each layer's weights as its
# checkpoint tensors arrive and quantizes the layer as soon as they are complete
# (pyorch/model_loader/layerwise.py), so the whole float model is never in memory at once.
# Outside it (a layer built by hand, as the tests do) the weights are allocated as usual.
_ONLINE_WEIGHTS_ON_META = False


@contextlib.contextmanager
def online_weights_on_meta() -> Iterator[None]:
    global _ONLINE_WEIGHTS_ON_META
    previous, _ONLINE_WEIGHTS_ON_META = _ONLINE_WEIGHTS_ON_META, True
    try:
        yield
    finally:
        _ONLINE_WEIGHTS_ON_META = previous


def online_weight_device() -> torch.device | None:
    """Where a method creates the float weights it quantizes after loading: the meta device under
    `online_weights_on_meta()`, else None (the default device)."""
    return torch.device("meta") if _ONLINE_WEIGHTS_ON_META else None


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme (from config.json's `quantization_config`)."""

    # HF shard names of our merged layers, for ignore lists written in checkpoint names.
    packed_modules_mapping: Mapping[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The `--quantization` name, e.g. "fp8"."""

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        """Activation dtypes the method's kernels take."""
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        """Lowest CUDA compute capability (major * 10 + minor) the method runs on."""
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        """Files besides config.json that hold the scheme (e.g. quantize_config.json)."""
        return []

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Builds the scheme from the checkpoint's quantization_config dict."""

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None
    ) -> str | None:
        """The name of this method if it should serve a checkpoint made for another (e.g.
        gptq_marlin for a gptq checkpoint), else None."""
        return None

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for the layer named `prefix`, or None to leave it unquantized."""

    def is_layer_skipped(self, prefix: str) -> bool:
        """Whether the layer named `prefix` stays unquantized (the config's ignore list)."""
        return False

    @staticmethod
    def get_from_keys(config: dict[str, Any], keys: list[str]) -> Any:
        """The value of the first of `keys` present in config; ValueError naming them if none."""
        for key in keys:
            if key in config:
                return config[key]
        raise ValueError(f"Cannot find any of {keys} in the model's quantization config.")

    @staticmethod
    def get_from_keys_or(config: dict[str, Any], keys: list[str], default: Any) -> Any:
        try:
            return QuantizationConfig.get_from_keys(config, keys)
        except ValueError:
            return default


def is_layer_skipped(
    prefix: str, ignored: Iterable[str], packed_modules_mapping: Mapping[str, list[str]],
    matches: Callable[[str, str], bool] | None = None,
) -> bool:
    """Whether `prefix` (our module name) is in an ignore list written in checkpoint names.
    A merged layer (qkv_proj) is skipped when all its shards are, and raises when only some
    are (one GEMM cannot be half quantized). `matches(name, entry)` defaults to equality."""
    entries = list(ignored)
    match = matches or (lambda name, entry: name == entry)

    def listed(name: str) -> bool:
        return any(match(name, entry) for entry in entries)

    last = prefix.rsplit(".", 1)[-1]
    shards = packed_modules_mapping.get(last)
    if not shards:
        return listed(prefix)
    names = [prefix[: len(prefix) - len(last)] + shard for shard in shards]
    skipped = [listed(name) for name in names]
    if any(skipped) and not all(skipped):
        raise ValueError(
            f"{prefix} merges {', '.join(names)}, of which only some are in the quantization "
            "config's ignore list: a merged layer must be all quantized or all not")
    return all(skipped)


def check_moe_unquantized(quant_config: QuantizationConfig | None, prefix: str) -> None:
    """Raises for a quantized MoE expert block: FusedMoE has no quantized method yet, and a
    quantized checkpoint's experts must not silently run in bf16 (or fail to load)."""
    if quant_config is None or quant_config.is_layer_skipped(prefix):
        return
    raise NotImplementedError(
        f"{quant_config.get_name()} quantization does not cover mixture-of-experts layers "
        f"(FusedMoE at {prefix!r}) yet; run this model unquantized, or list its experts in the "
        "config's ignore list")


# ---- the registry ----------------------------------------------------------------------------
_CONFIGS: dict[str, type[QuantizationConfig]] = {}
_LOADED = False
_C = TypeVar("_C", bound=type[QuantizationConfig])


def register_quantization_config(name: str) -> Callable[[_C], _C]:
    """Class decorator: makes `name` a `quantization=` value served by the class."""

    def register(cls: _C) -> _C:
        if name in _CONFIGS and _CONFIGS[name] is not cls:
            raise ValueError(f"quantization method {name!r} is already registered by "
                             f"{_CONFIGS[name].__name__}")
        _CONFIGS[name] = cls
        return cls

    return register


def _load_methods() -> None:
    """Imports every module of this package once, so their decorators register them."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


def get_quantization_methods() -> list[str]:
    """Every registered `quantization=` name, sorted."""
    _load_methods()
    return sorted(_CONFIGS)


def get_quantization_config(name: str) -> type[QuantizationConfig]:
    """The config class of quantization method `name`; ValueError listing the known ones."""
    _load_methods()
    if name not in _CONFIGS:
        raise ValueError(f"Unknown quantization method {name!r}. Known methods: "
                         f"{', '.join(get_quantization_methods())}")
    return _CONFIGS[name]


def __getattr__(attr: str) -> Any:
    # QUANTIZATION_METHODS (vLLM's name) is computed on first use: listing it imports the methods.
    if attr == "QUANTIZATION_METHODS":
        return get_quantization_methods()
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
