"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, llm-compressor's output),
parsed with the `compressed_tensors` package's own config classes.

Each linear layer gets the scheme of the config group whose `targets` match it ("Linear", a
module name or "re:" pattern; merged layers through their checkpoint shards, which must agree),
unless `ignore` lists it. A scheme is chosen from `SCHEMES`, a small table of (name, predicate
over (weights, input_activations, format), factory): the first whose predicate holds. Schemes
that no entry takes are refused at load time, naming the scheme. Other modules add entries with
`register_scheme` (the W4A16 `pack-quantized` scheme plugs in there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pyorch.layers.linear import LinearBase, LinearMethodBase
from pyorch.layers.quantization import (
    QuantizationConfig,
    QuantizeMethodBase,
    is_layer_skipped,
    register_quantization_config,
)
from pyorch.layers.quantization.compressed_tensors_schemes import (
    CompressedTensorsScheme,
    CompressedTensorsW8A8Fp8,
    CompressedTensorsW8A8Int8,
)

# (weights args, input_activations args or None, format) -> whether a scheme serves them.
SchemePredicate = Callable[[Any, Any, str], bool]
SchemeFactory = Callable[[Any, Any, str], CompressedTensorsScheme]
SCHEMES: list[tuple[str, SchemePredicate, SchemeFactory]] = []


def register_scheme(name: str, matches: SchemePredicate, build: SchemeFactory) -> None:
    """Adds a scheme to the dispatch table (tried in registration order)."""
    SCHEMES.append((name, matches, build))


def _is_8bit(args: Any, qtype: str) -> bool:
    return args is not None and args.num_bits == 8 and str(args.type) == qtype


def _w8a8(qtype: str) -> SchemePredicate:
    def matches(weights: Any, acts: Any, fmt: str) -> bool:
        return (
            _is_8bit(weights, qtype) and _is_8bit(acts, qtype) and weights.symmetric
            and not weights.dynamic and str(weights.strategy) in ("tensor", "channel")
            # static: one scale for the tensor; dynamic: per token (or per tensor for fp8)
            and (str(acts.strategy) == "tensor" if not acts.dynamic else
                 str(acts.strategy) == "token" or (qtype == "float"
                                                   and str(acts.strategy) == "tensor"))
            and (qtype == "int" or acts.symmetric)
        )
    return matches


register_scheme("W8A8-FP8", _w8a8("float"), CompressedTensorsW8A8Fp8.from_args)
register_scheme("W8A8-INT8", _w8a8("int"), CompressedTensorsW8A8Int8.from_args)
# The W4A16 pack-quantized scheme registers itself with register_scheme in its own module:
from pyorch.layers.quantization import compressed_tensors_w4a16  # noqa: E402,F401


def _describe(weights: Any, acts: Any, fmt: str) -> str:
    def one(args: Any) -> str:
        if args is None:
            return "none"
        return (f"{args.type}{args.num_bits} {args.strategy}"
                f"{' dynamic' if args.dynamic else ''}{'' if args.symmetric else ' asymmetric'}")
    return f"format {fmt!r}, weights {one(weights)}, input_activations {one(acts)}"


@register_quantization_config("compressed-tensors")
class CompressedTensorsConfig(QuantizationConfig):
    def __init__(self, quant_config: Any):
        """quant_config: a compressed_tensors.quantization.QuantizationConfig."""
        self.quant_config = quant_config
        self.ignore = list(quant_config.ignore or [])
        self.format = str(quant_config.format or "dense")
        self.groups = list(quant_config.config_groups.items())
        if quant_config.kv_cache_scheme is not None:
            raise ValueError("compressed-tensors: kv_cache_scheme (fp8 KV-cache scales) is not "
                             "supported yet")
        for name, scheme in self.groups:
            if scheme.output_activations is not None:
                raise ValueError(f"compressed-tensors: config group {name!r} quantizes output "
                                 "activations, which pyorch does not support")

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors"

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        from compressed_tensors.quantization import QuantizationConfig as CTQuantizationConfig

        sparsity = config.get("sparsity_config") or {}
        if sparsity:
            raise ValueError("compressed-tensors: sparsity_config (2:4 sparse weights) is not "
                             "supported")
        fields = {k: v for k, v in config.items() if k != "sparsity_config"}
        return cls(CTQuantizationConfig.model_validate(fields))

    def _matches(self, name: str, entry: str) -> bool:
        from compressed_tensors.utils import match_name

        return bool(match_name(name, entry))

    def is_layer_skipped(self, prefix: str) -> bool:
        return is_layer_skipped(prefix, self.ignore, self.packed_modules_mapping, self._matches)

    def _group_for(self, name: str) -> tuple[str, Any] | None:
        for group_name, scheme in self.groups:
            for target in scheme.targets:
                if target == "Linear" or self._matches(name, target):
                    return group_name, scheme
        return None

    def scheme_for(self, prefix: str) -> CompressedTensorsScheme | None:
        """The scheme of the layer named `prefix` (None: unquantized); ValueError for a scheme
        pyorch has no kernel for, or for merged shards in different groups."""
        last = prefix.rsplit(".", 1)[-1]
        shards = self.packed_modules_mapping.get(last)
        names = [prefix[: len(prefix) - len(last)] + s for s in shards] if shards else [prefix]
        found = {name: self._group_for(name) for name in names}
        groups = {g[0] if g else None for g in found.values()}
        if len(groups) > 1:
            raise ValueError(f"compressed-tensors: {prefix} merges {', '.join(names)}, which are "
                             f"in different config groups ({sorted(map(str, groups))})")
        group = next(iter(found.values()))
        if group is None:
            return None
        group_name, scheme = group
        fmt = str(getattr(scheme, "format", None) or self.format)
        for _, matches, build in SCHEMES:
            if matches(scheme.weights, scheme.input_activations, fmt):
                return build(scheme.weights, scheme.input_activations, fmt)
        described = _describe(scheme.weights, scheme.input_activations, fmt)
        supported = ", ".join(name for name, _, _ in SCHEMES)
        raise ValueError(f"compressed-tensors: config group {group_name!r} ({described}) is not "
                         f"a supported scheme; supported: {supported}")

    def get_quant_method(self, layer: Any, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase) or self.is_layer_skipped(prefix):
            return None
        scheme = self.scheme_for(prefix)
        return None if scheme is None else CompressedTensorsLinearMethod(scheme)


class CompressedTensorsLinearMethod(LinearMethodBase):
    """A linear layer computed by its compressed-tensors scheme."""

    def __init__(self, scheme: CompressedTensorsScheme):
        self.scheme = scheme

    def create_weights(
        self,
        layer: Any,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        layer.output_partition_sizes = output_partition_sizes
        self.scheme.create_weights(layer, input_size_per_partition, output_partition_sizes,
                                   params_dtype, extra_weight_attrs["weight_loader"])

    def process_weights_after_loading(self, layer: Any) -> None:
        self.scheme.process_weights_after_loading(layer)

    def apply(
        self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.scheme.apply_weights(layer, x, bias)

    def accepts_fp8_activation(self, layer: Any) -> bool:
        """Whether apply takes an Fp8Activation (w8a8_utils.rms_norm_fp8_input): the W8A8-FP8
        scheme with dynamic per-token activations."""
        s = self.scheme
        return (isinstance(s, CompressedTensorsW8A8Fp8) and not s.static_input and s.per_token
                and layer.weight.dtype == torch.float8_e4m3fn)
