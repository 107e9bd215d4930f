"""Checkpoint loading shared by the models: HF names -> merged, sharded parameters."""

from collections.abc import Iterable

import torch
from torch import nn

from pyorch.layers.linear import default_weight_loader

# (our parameter name part, HF name part, shard id) for the merged projections of decoder models.
LLAMA_STACKED_PARAMS: list[tuple[str, str, str | int]] = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]

# Non-parameter tensors some checkpoints carry (precomputed rotary tables).
ROTARY_BUFFER_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: list[tuple[str, str, str | int]],
    skip_prefixes: tuple[str, ...] = (),
) -> set[str]:
    """Loads HF-named tensors into `model`, routing split projections into merged parameters.

    Raises KeyError naming the tensor for a checkpoint tensor the model has no place for, and
    for parameters (or shards of merged ones) that no tensor filled. Returns the names loaded.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    expected_shards: dict[str, set[str | int]] = {}
    for param_part, _, shard_id in stacked_params:
        for name in params:
            if param_part + "." in name:
                expected_shards.setdefault(name, set()).add(shard_id)
    loaded_shards: dict[str, set[str | int]] = {}
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        if hf_name.endswith(ROTARY_BUFFER_SUFFIXES) or hf_name.startswith(skip_prefixes):
            continue
        for param_part, hf_part, shard_id in stacked_params:
            if hf_part + "." not in hf_name:
                continue
            name = hf_name.replace(hf_part + ".", param_part + ".")
            param = _param_or_raise(params, name, hf_name)
            weight_loader = getattr(param, "weight_loader", None)
            if weight_loader is None:  # set by the stacked layer (e.g. QKVParallelLinear)
                raise AttributeError(f"{name}: a stacked parameter has no weight_loader")
            weight_loader(param, tensor, shard_id)
            loaded_shards.setdefault(name, set()).add(shard_id)
            break
        else:
            name = hf_name
            param = _param_or_raise(params, name, hf_name)
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        loaded.add(name)
    _check_complete(params, loaded, expected_shards, loaded_shards, skip_prefixes)
    return loaded


def _param_or_raise(params: dict[str, nn.Parameter], name: str, hf_name: str) -> nn.Parameter:
    if name not in params:
        raise KeyError(
            f"Unexpected weight {hf_name!r} in the checkpoint: the model has no parameter "
            f"{name!r}. Is the checkpoint for a different architecture or config?"
        )
    return params[name]


def _check_complete(
    params: dict[str, nn.Parameter],
    loaded: set[str],
    expected_shards: dict[str, set[str | int]],
    loaded_shards: dict[str, set[str | int]],
    skip_prefixes: tuple[str, ...],
) -> None:
    missing = []
    for name in params:
        if name.startswith(skip_prefixes):
            continue
        if name in expected_shards:
            absent = expected_shards[name] - loaded_shards.get(name, set())
            if name in loaded and absent and name in loaded_shards:
                missing.append(f"{name} (shards {sorted(map(str, absent))})")
            elif name not in loaded:
                missing.append(name)
        elif name not in loaded:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10
                                           else "")
        raise KeyError(f"Checkpoint is missing weights for: {shown}")
