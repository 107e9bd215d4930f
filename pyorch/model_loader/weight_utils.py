"""Checkpoint readers for Hugging Face directories, and dummy (random) weights.

Every reader is a generator of ``(hf_name, tensor)`` that opens one shard at a time and reads one
tensor at a time, so peak host memory stays near the largest tensor (safetensors memory-maps).
"""

from __future__ import annotations

import glob
import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterator

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


_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def iterate_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) from every safetensors shard of ``model_dir``, lazily.

    The tensors are views of the file, memory-mapped copy-on-write: no byte is read until used.
    A tensor-parallel rank narrows each to its shard before copying it to the device, so it
    reads only its shard's pages (whole rows of a row-split weight, a slice of each row of a
    column-split one)."""
    files = safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    for file in files:
        yield from _mapped_safetensors(file)


def _mapped_safetensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one safetensors file (8-byte header length, JSON header, data), in file
    order, as views of a private memory map of it."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
            header = json.loads(f.read(header_len))
            entries = sorted(
                ((name, _SAFETENSORS_DTYPES[info["dtype"]], [int(d) for d in info["shape"]],
                  int(info["data_offsets"][0]), int(info["data_offsets"][1]))
                 for name, info in header.items() if name != "__metadata__"),
                key=lambda e: e[3])
        except (struct.error, ValueError, UnicodeDecodeError, KeyError, TypeError,
                AttributeError, IndexError) as e:
            raise ValueError(f"{file}: unreadable safetensors file ({type(e).__name__}: {e})"
                             ) from e
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    base = 8 + header_len
    for name, dtype, shape, begin, end in entries:
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(shape)
        if end - begin != numel * itemsize or base + end > size or begin < 0:
            raise ValueError(f"{file}: unreadable safetensors file (tensor {name!r}: offsets "
                             f"[{begin}, {end}) do not fit shape {shape} of {dtype})")
        offset = base + begin
        if numel == 0 or mapped is None:
            yield name, torch.empty(shape, dtype=dtype)
        elif offset % itemsize == 0:
            yield name, torch.frombuffer(mapped, dtype=dtype, count=numel,
                                         offset=offset).view(shape)
        else:  # the format does not promise alignment: such a tensor is copied out whole
            data = bytearray(mapped[offset : offset + numel * itemsize])
            yield name, torch.frombuffer(data, dtype=dtype).view(shape)


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
    alone. The same seed, model and device give the same weights. A quantized checkpoint's scales
    (parameters named `*scale`, `*scale_inv`, `scales`) are drawn in [high / 2, high) instead:
    a dequantization scale must be positive (the fp8 MoE method re-quantizes each expert's
    gate and up halves to one scale at load, and its quantize op refuses a scale <= 0).
    Parameters on the meta device (float weights quantized as they load) are skipped: the loader
    fills those layer by layer with `dummy_filler` (pyorch/model_loader/layerwise.py).
    """
    fill = dummy_filler(low, high, seed)
    for name, param in model.named_parameters():
        if not param.is_meta:
            fill(name, param)


def dummy_filler(
    low: float = -1e-3, high: float = 1e-3, seed: int = 1234
) -> Callable[[str, torch.Tensor], None]:
    """`fill(name, param)`: initialize_dummy_weights' draw for one parameter, from one seeded
    generator per device shared by every call of this filler."""
    generators: dict[torch.device, torch.Generator] = {}

    def fill(name: str, param: torch.Tensor) -> None:
        if not torch.is_floating_point(param):
            return
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        gen = generators[param.device]
        lo, hi = low, high
        if _is_scale(name):
            lo, hi = max(abs(low), abs(high)) / 2, max(abs(low), abs(high))
        with torch.no_grad():
            if param.element_size() < 2:  # fp8 and friends have no uniform_: draw in fp16, cast
                tmp = torch.empty(param.shape, dtype=torch.float16, device=param.device)
                param.copy_(tmp.uniform_(lo, hi, generator=gen))
            else:
                param.uniform_(lo, hi, generator=gen)

    return fill


def _is_scale(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf.endswith("scale") or leaf.endswith("scale_inv") or leaf == "scales"


# ---- fp8 KV-cache scales ------------------------------------------------------------------------
# Checkpoint names of per-layer KV-cache scales (vLLM's set): the attention's own `k_scale` /
# `v_scale` (`<attn>.k_scale`, with or without vLLM's inner `.attn`), ModelOpt's
# `k_proj.k_scale` / `v_proj.v_scale`, compressed-tensors' `kv_cache_scheme` outputs
# `k_proj.output_scale` / `v_proj.output_scale`, and the deprecated single `kv_scale` (both).
_KV_SCALE_SUFFIXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (".k_proj.output_scale", ("k_scale",)),
    (".v_proj.output_scale", ("v_scale",)),
    (".k_proj.k_scale", ("k_scale",)),
    (".v_proj.v_scale", ("v_scale",)),
    (".kv_scale", ("k_scale", "v_scale")),
    (".k_scale", ("k_scale",)),
    (".v_scale", ("v_scale",)),
)
# Scales of things pyorch does not quantize (the query, the probabilities): the attention runs
# them in the model dtype, as vLLM's backends without fp8 attention do.
_UNUSED_ATTN_SCALE_SUFFIXES = (".q_proj.output_scale", ".q_scale", ".prob_scale")


def maybe_remap_kv_scale_name(name: str, attn_names: set[str]) -> list[str] | None:
    """The Attention buffers (``"<module>.k_scale"``/``"<module>.v_scale"``) that checkpoint
    tensor ``name`` sets, or None when ``name`` is no KV-cache scale. ``attn_names``: the
    model's Attention module names (``model.layers.0.self_attn.attn``). A scale for a layer the
    model has no Attention module for raises KeyError naming it."""
    for suffix, buffers in _KV_SCALE_SUFFIXES:
        if not name.endswith(suffix):
            continue
        owner = name[: -len(suffix)]  # "model.layers.0.self_attn" (or "...self_attn.attn")
        module = next((m for m in (owner + ".attn", owner) if m in attn_names), None)
        if module is None:
            raise KeyError(f"KV-cache scale {name!r} in the checkpoint: the model has no "
                           f"attention layer at {owner!r}")
        return [f"{module}.{b}" for b in buffers]
    return None


def load_kv_scales(
    model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes ``weights`` through to the model's loader, less the KV-cache scales, which it
    writes into the Attention layers' ``k_scale``/``v_scale`` (in place: the device tensors the
    ops and any CUDA graph read). A scale must be one positive finite number (per-tensor, as
    the cache ops take); anything else raises ValueError naming it."""
    from pyorch.layers.attention import Attention

    attn_names = {n for n, m in model.named_modules() if isinstance(m, Attention)}
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for name, tensor in weights:
        if name.endswith(_UNUSED_ATTN_SCALE_SUFFIXES):
            continue
        targets = maybe_remap_kv_scale_name(name, attn_names)
        if targets is None:
            yield name, tensor
            continue
        if tensor.numel() != 1:
            raise ValueError(f"KV-cache scale {name!r} has shape {tuple(tensor.shape)}: only "
                             "per-tensor scales (one number per layer) are supported")
        value = float(tensor.reshape(()).float())
        if not math.isfinite(value) or value <= 0.0:
            raise ValueError(f"KV-cache scale {name!r} is {value}: it must be positive")
        for target in targets:
            buffers[target].fill_(value)
