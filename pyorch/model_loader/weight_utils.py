"""Checkpoint readers for Hugging Face directories, and dummy (random) weights.

Every reader is a generator of ``(hf_name, tensor)`` that opens one shard at a time and reads one
tensor at a time, so peak host memory stays near the largest tensor (safetensors memory-maps).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from torch import nn

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"


def _read_index(index_file: str) -> list[str]:
    """The shard files named by a ``*.index.json``'s ``weight_map``, in first-seen order."""
    try:
        with open(index_file, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        shards = list(dict.fromkeys(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index_file}: malformed index ({type(e).__name__}: {e})") from e
    folder = os.path.dirname(index_file)
    files = [os.path.join(folder, shard) for shard in shards]
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"{index_file}: names shard {os.path.basename(file)}, which is missing"
            )
    return files


def _checkpoint_files(model_dir: str, index_name: str, pattern: str) -> list[str]:
    index_file = os.path.join(model_dir, index_name)
    if os.path.isfile(index_file):
        return _read_index(index_file)
    return sorted(glob.glob(os.path.join(model_dir, pattern)))


def safetensors_files(model_dir: str) -> list[str]:
    """The safetensors shards of ``model_dir`` (from the index when there is one)."""
    return _checkpoint_files(model_dir, SAFETENSORS_INDEX, "*.safetensors")


def pt_files(model_dir: str) -> list[str]:
    """The PyTorch ``.bin`` shards of ``model_dir`` (from the index when there is one)."""
    return _checkpoint_files(model_dir, PT_INDEX, "*.bin")


def iterate_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) from every safetensors shard of ``model_dir``, lazily."""
    from safetensors import SafetensorError, safe_open

    files = safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file}: unreadable safetensors file ({e})") from e


def iterate_pt_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) from every PyTorch ``.bin`` shard (loaded with weights_only)."""
    files = pt_files(model_dir)
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.bin files")
    for file in files:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # pickle/zip errors have many types
            raise ValueError(f"{file}: unreadable PyTorch checkpoint ({e})") from e
        yield from state.items()
        del state


@torch.no_grad()
def initialize_dummy_weights(
    model: nn.Module, low: float = -1e-3, high: float = 1e-3, seed: int = 1234
) -> None:
    """Fill every floating-point parameter of ``model`` with uniform values in [low, high).

    Values are generated on each parameter's own device (one seeded generator per device), so an
    8B-shaped model on a GPU fills in well under a second. Buffers (RoPE caches, ...) are left
    alone. The same seed, model and device give the same weights.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if not torch.is_floating_point(param):
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        gen = generators[param.device]
        if param.element_size() < 2:  # fp8 and friends have no uniform_: draw in fp16, cast
            tmp = torch.empty(param.shape, dtype=torch.float16, device=param.device)
            param.copy_(tmp.uniform_(low, high, generator=gen))
        else:
            param.uniform_(low, high, generator=gen)
