"""Online quantization while the weights load: the whole float model is never in memory.

`quantization="fp8"` on a bf16 checkpoint quantizes every linear and expert weight after loading.
Loaded first and quantized after, a model needs its float size in memory (a 70B model 141 GB
where its fp8 form is 71 GB). vLLM 0.26 streams instead (its online fp8 method creates the float
weights on the meta device and quantizes each layer as soon as its weights are in); so does this:

- While `get_model` builds the model under `online_weights_on_meta()`, a method that quantizes
  after loading creates those float weights on the meta device (no memory).
- `LayerwiseQuantizer(model, device)` finds them and wraps their weight loaders. The first
  checkpoint tensor of a layer materializes its float weights on the device; each loader call
  counts the elements it writes into them (the `copy_`s into the parameter's storage); when every
  element of every such weight is written, the layer's `process_weights_after_loading` runs at
  once and the float storage is released, even where the model's loader still holds the
  parameter object (`load_stacked_weights` keeps a dict of them for the whole loop).
- `finish()` after the loop quantizes layers whose count fell short (a loader wrote through an
  op it does not count) and raises for a layer whose weights never arrived. The dummy load format
  fills and quantizes layer by layer (`fill_dummy`).

So the float weights alive at any time are those of the layers whose tensors are arriving: one
layer for a checkpoint stored in layer order. `peak_float_bytes` records the most, and
`get_model` logs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pyorch.layers.linear import default_weight_loader
from pyorch.layers.quantization import QuantizeMethodBase

logger = logging.getLogger(__name__)

# Set on a module whose process_weights_after_loading already ran (the loader's final pass skips
# it).
PROCESSED_ATTR = "_pyorch_weights_processed"


class _WriteCounter(TorchDispatchMode):
    """Counts the elements `copy_` writes into one tensor's storage while it is active."""

    def __init__(self, target: torch.Tensor):
        super().__init__()
        self._storage = target.untyped_storage().data_ptr()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func is torch.ops.aten.copy_.default:
            dst = args[0]
            if dst.untyped_storage().data_ptr() == self._storage:
                self.count += dst.numel()
        return func(*args, **(kwargs or {}))


class _Layer:
    """One module whose float weights load on demand and are quantized once complete."""

    def __init__(self, prefix: str, module: nn.Module, names: list[str],
                 owner: LayerwiseQuantizer):
        self.prefix, self.module, self.owner = prefix, module, owner
        self.total = {n: getattr(module, n).numel() for n in names}
        self.written = dict.fromkeys(names, 0)
        self.live: dict[str, nn.Parameter] = {}  # materialized float weights
        self.done = False
        for name in names:
            meta = getattr(module, name)
            original = getattr(meta, "weight_loader", None) or default_weight_loader
            meta.weight_loader = self._loader(name, original)

    def _loader(self, name: str, original: Callable[..., None]) -> Callable[..., None]:
        def load(param: nn.Parameter, loaded_weight: torch.Tensor, *args: Any,
                 **kwargs: Any) -> None:
            if self.done:
                raise RuntimeError(
                    f"{self.prefix}.{name}: a checkpoint tensor arrived after the layer's weights "
                    "were complete and quantized (is a tensor in the checkpoint twice?)")
            real = self.materialize(name)
            counter = _WriteCounter(real)
            with counter:
                original(real, loaded_weight, *args, **kwargs)
            self.written[name] += counter.count
            if all(self.written[n] >= self.total[n] for n in self.total):
                self.process()
        return load

    def materialize(self, name: str) -> nn.Parameter:
        """The module's parameter `name` on the device, allocated (uninitialized) on first use:
        a parameter of the meta one's class carrying its attributes (loader, shard dims)."""
        param = getattr(self.module, name)
        if not param.is_meta:
            return param
        data = torch.empty(param.shape, dtype=param.dtype, device=self.owner.device)
        cls: Any = type(param)  # nn.Parameter or a BasevLLMParameter subclass
        real = cls.__new__(cls, data=data, requires_grad=False)
        real.__dict__.update(param.__dict__)
        delattr(self.module, name)
        self.module.register_parameter(name, real)
        self.live[name] = real
        self.owner.add_live(real.numel() * real.element_size())
        return real

    def process(self) -> None:
        """Quantize now, then free the float weights the method replaced."""
        self.done = True
        method = self.module.quant_method
        assert isinstance(method, QuantizeMethodBase)
        method.process_weights_after_loading(self.module)
        setattr(self.module, PROCESSED_ATTR, True)
        kept = {p.untyped_storage().data_ptr() for p in self.module.parameters(recurse=False)}
        for real in self.live.values():
            self.owner.add_live(-real.numel() * real.element_size())
            if real.untyped_storage().data_ptr() not in kept:
                # Other references to the parameter object (a loader's dict) keep no storage.
                real.data = torch.empty(0, dtype=real.dtype, device=real.device)
        self.live.clear()


class LayerwiseQuantizer:
    """The layers of `model` with float weights on the meta device (see the module docstring);
    `device` is where they are materialized."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.device = device
        self.live_float_bytes = 0
        self.peak_float_bytes = 0
        self.layers: list[_Layer] = []
        for prefix, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if not isinstance(method, QuantizeMethodBase):
                continue
            names = [n for n, p in module.named_parameters(recurse=False) if p.is_meta]
            if names:
                self.layers.append(_Layer(prefix, module, names, self))

    def __bool__(self) -> bool:
        return bool(self.layers)

    def add_live(self, nbytes: int) -> None:
        self.live_float_bytes += nbytes
        self.peak_float_bytes = max(self.peak_float_bytes, self.live_float_bytes)

    def finish(self) -> None:
        """After the checkpoint's tensors: quantize the layers not yet quantized; raise for one
        whose weights never arrived."""
        missing = [f"{layer.prefix}.{name}" for layer in self.layers if not layer.done
                   for name in layer.total if getattr(layer.module, name).is_meta]
        if missing:
            shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more"
                                               if len(missing) > 10 else "")
            raise KeyError(f"Checkpoint is missing weights for: {shown}")
        for layer in self.layers:
            if not layer.done:
                layer.process()

    def fill_dummy(self, fill: Callable[[str, nn.Parameter], None]) -> None:
        """The dummy load format: each layer's float weights materialized, filled by
        `fill(name, param)` and quantized, one layer at a time."""
        for layer in self.layers:
            for name in layer.total:
                fill(f"{layer.prefix}.{name}", layer.materialize(name))
            layer.process()
