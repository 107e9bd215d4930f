"""Quantization interfaces. Only the base classes live here today; methods (fp8, AWQ, GPTQ, ...)
subclass them and plug into the linear layers through `LinearBase(quant_method=...)`."""

from abc import ABC, abstractmethod
from typing import Any

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


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme (from config.json's `quantization_config`)."""

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The `--quantization` name, e.g. "fp8"."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantizationConfig":
        """Builds the scheme from the checkpoint's quantization_config dict."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for the layer named `prefix`, or None to leave it unquantized."""
