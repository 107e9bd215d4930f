"""GGUF files: the Hugging Face config from the metadata, and the weights under HF names.

Supported architectures are llama, qwen2 and qwen3 (``general.architecture``), and the
mixture-of-experts files qwen3moe (Qwen3-MoE) and llama with ``llama.expert_count`` (Mixtral, as
llama.cpp converts it). Linear and embedding weights keep their GGUF blocks (see
:func:`gguf_tensor`); an MoE file's stacked expert tensors (``ffn_{gate,up,down}_exps``, [E, N,
K]) are dequantized to float32 at load and handed over per expert under the HF names (FusedMoE
computes in the model dtype: the experts' memory is that of an unquantized model). Names are
mapped to the Hugging Face checkpoint names the models' ``load_weights`` expects, GGML's dims
order (fastest first) is reversed to torch's, and llama.cpp's rotary row permutation of q/k is
undone for llama files (on rows of blocks as on float rows).
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import CONFIG_MAPPING, PretrainedConfig

from pyorch import _ops

# general.architecture -> (HF model_type, HF architecture class name)
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
# A llama file with experts is Mixtral (llama.cpp's converter writes Mixtral as llama).
_LLAMA_MOE = ("mixtral", "MixtralForCausalLM")
# The HF module of an MoE layer's router and experts, by HF model_type.
_MOE_MODULE = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}
# GGUF expert tensor -> the HF per-expert projection, by HF model_type.
_EXPERT_PROJ = {
    "qwen3_moe": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    "mixtral": {"gate": "w1", "up": "w3", "down": "w2"},
}
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")

# Architectures whose converter permutes q/k rows for llama.cpp's interleaved rotary.
_PERMUTED_QK_ARCHITECTURES = {"llama"}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that carry no weight of the HF model (rope_freqs is folded into the config).
_SKIPPED_TENSORS = {"rope_freqs.weight"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _file_key(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return os.path.realpath(path), st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=2)
def _open_cached(key: tuple[str, int, int]) -> Any:
    from gguf import GGUFReader

    return GGUFReader(key[0], "r")


def open_gguf(path: str) -> Any:
    """A ``gguf.GGUFReader`` for ``path``, shared between the config and weight readers
    (gguf-py parses the tokenizer arrays field by field, which takes seconds)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return _open_cached(_file_key(path))
    except Exception as e:  # gguf-py raises ValueError/IndexError/... on damaged files
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader: Any, key: str, default: Any = KeyError) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is KeyError:
            raise KeyError(key)
        return default
    return field.contents()


def _f32_value(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06), which is what the original config.json held."""
    return float(str(np.float32(value)))


def _tensor_shape(tensor: Any) -> tuple[int, ...]:
    """Torch order: GGML stores ne[0] (the contiguous dim) first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def _llama3_rope_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, original_max: int
) -> dict[str, Any]:
    """Recover HF's llama3 rope parameters from llama.cpp's ``rope_freqs`` tensor.

    factors: [head_dim // 2] float32, the divisor applied to each inverse frequency. llama3 keeps
    high frequencies (factor 1), divides low ones by ``factor``, and between the two wavelengths
    ``original_max / high_freq_factor`` and ``original_max / low_freq_factor`` blends with
    ``smooth = (original_max / wavelen - low) / (high - low)``, which is linear in 1 / wavelen:
    a line fit over the blended dims gives low and high. Raises ValueError when the factors do
    not follow that shape.
    """
    factor = float(factors.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = original_max * inv_freq / (2 * math.pi)  # original_max / wavelen
    blended = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor <= 1 or blended.sum() < 2:
        raise ValueError("rope_freqs does not have llama3's blended band of frequencies")
    smooth = (1 / factors[blended] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(x[blended], smooth, 1)
    low = -intercept / slope
    high = low + 1 / slope
    low_freq_factor = float(round(low, 4))
    high_freq_factor = float(round(high, 4))
    params: dict[str, Any] = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low_freq_factor,
        "high_freq_factor": high_freq_factor,
        "original_max_position_embeddings": original_max,
    }
    s = np.clip((x - low_freq_factor) / (high_freq_factor - low_freq_factor), 0, 1)
    expected = 1 / ((1 - s) / factor + s)
    if not np.allclose(expected, factors, rtol=1e-3):
        raise ValueError("rope_freqs does not follow llama3 scaling")
    return params


def _rope_scaling(reader: Any, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        orig = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192))
        factors = gguf_tensor(freqs).numpy()
        return _llama3_rope_from_factors(factors, theta, head_dim, orig)
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"rope scaling type {kind!r} is not supported")
    params: dict[str, Any] = {"rope_type": kind}
    params["factor"] = _f32_value(_field(reader, f"{arch}.rope.scaling.factor"))
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length", None)
    if orig is not None:
        params["original_max_position_embeddings"] = int(orig)
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = _field(reader, f"{arch}.rope.scaling.{gguf_key}", None)
        if value is not None:
            params[hf_key] = _f32_value(value)
    return params


def gguf_to_hf_config(path: str) -> PretrainedConfig:
    """Build the Hugging Face config of a llama / qwen2 / qwen3 / qwen3moe GGUF file (or a
    Mixtral one: llama with experts) from its metadata.

    The config's dtype is float32 (the activations; the weights keep their GGUF types), and
    ``resolve_dtype`` then keeps float32 on the CPU and picks a 16-bit type on a GPU.
    """
    reader = open_gguf(path)
    try:
        arch = _field(reader, "general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported (supported: {sorted(GGUF_ARCHITECTURES)})"
            )
        model_type, architecture = GGUF_ARCHITECTURES[arch]
        num_experts = int(_field(reader, f"{arch}.expert_count", 0))
        if arch == "llama" and num_experts > 0:
            model_type, architecture = _LLAMA_MOE
        tensors = {t.name: t for t in reader.tensors}
        if "token_embd.weight" not in tensors:
            raise ValueError("no token_embd.weight tensor")
        hidden_size = int(_field(reader, f"{arch}.embedding_length"))
        num_heads = int(_field(reader, f"{arch}.attention.head_count"))
        head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden_size // num_heads))
        theta = _f32_value(_field(reader, f"{arch}.rope.freq_base", 10000.0))
        kwargs: dict[str, Any] = dict(
            architectures=[architecture],
            vocab_size=_tensor_shape(tensors["token_embd.weight"])[0],
            hidden_size=hidden_size,
            intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
            num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=_f32_value(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
            rope_theta=theta,
            rope_scaling=_rope_scaling(reader, arch, theta, head_dim),
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
            eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", None),
            pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id", None),
            dtype="float32",
        )
        if arch == "llama" and num_experts == 0:
            kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
        if num_experts > 0:
            kwargs.update(_moe_config(reader, arch, model_type, num_experts))
        config = CONFIG_MAPPING[model_type](**kwargs)
    except KeyError as e:
        raise ValueError(f"{path}: GGUF metadata lacks {e.args[0]!r}") from e
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from e
    config.name_or_path = path
    return config


def _moe_config(reader: Any, arch: str, model_type: str, num_experts: int) -> dict[str, Any]:
    """The HF config fields of an MoE file's experts (KeyError for a missing key)."""
    top_k = int(_field(reader, f"{arch}.expert_used_count"))
    if model_type == "mixtral":
        return dict(num_local_experts=num_experts, num_experts_per_tok=top_k)
    return dict(
        num_experts=num_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=int(_field(reader, f"{arch}.expert_feed_forward_length")),
        norm_topk_prob=True,  # llama.cpp's qwen3moe always renormalizes the top-k weights
        decoder_sparse_step=1, mlp_only_layers=[],
    )


def _float_values(tensor: Any) -> torch.Tensor:
    """A GGUF tensor's values as float32 in torch's shape, dequantized if need be."""
    shape = _tensor_shape(tensor)
    ggml_type = int(tensor.tensor_type)
    data = np.asarray(tensor.data)
    if ggml_type == GGMLQuantizationType.BF16:
        values = torch.from_numpy(data.view(np.uint16).copy()).view(torch.bfloat16).float()
    elif ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = torch.from_numpy(data.copy()).float()
    else:
        rows = math.prod(shape[:-1])
        blocks = torch.from_numpy(data.copy()).reshape(rows, -1)
        values = _ops.ggml_dequantize(blocks, ggml_type, rows, shape[-1], torch.float32)
    return values.reshape(shape)


def _expert_tensors(tensor: Any, model_type: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked expert tensor blk.N.ffn_{gate,up,down}_exps ([E, N, K] in torch's order) as
    float32 per-expert matrices under the HF per-expert names."""
    match = _EXPERT_TENSOR.fullmatch(tensor.name)
    assert match is not None
    layer, part = match.groups()
    shape = _tensor_shape(tensor)
    if len(shape) != 3:
        raise ValueError(f"expert tensor of shape {shape}, expected [experts, rows, cols]")
    values = _float_values(tensor)
    prefix = f"model.layers.{layer}.{_MOE_MODULE[model_type]}.experts"
    proj = _EXPERT_PROJ[model_type][part]
    for e in range(shape[0]):
        yield f"{prefix}.{e}.{proj}.weight", values[e]


def gguf_name_to_hf(name: str, model_type: str | None = None) -> str | None:
    """The HF checkpoint name of a GGUF tensor; None for tensors that map to no weight."""
    if name in _SKIPPED_TENSORS:
        return None
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_TENSORS and kind in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    match = _LAYER_NAME.fullmatch(name)
    if match and match.group(2) == "ffn_gate_inp" and model_type in _MOE_MODULE:
        return f"model.layers.{match.group(1)}.{_MOE_MODULE[model_type]}.gate.{match.group(3)}"
    if match and match.group(2) in _LAYER_TENSORS:
        layer_idx, part, kind = match.groups()
        return f"model.layers.{layer_idx}.{_LAYER_TENSORS[part]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    weight: [num_heads * head_dim, ...] (a weight [rows, hidden] or a bias [rows]). The converter
    stores each head's rows as (head_dim // 2, 2) pairs, interleaving the two rotary halves;
    HF keeps them as (2, head_dim // 2), the first half then the second.
    """
    rows = weight.shape[0]
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)


def gguf_tensor(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as the model takes it. A matrix (linear or embedding weight) stays as in
    the file and is tagged with its GGML type (pyorch.layers.quantization.gguf.ggml_tensor):
    uint8 blocks [rows, row_bytes] for a quantized type, the float values for F32/F16/BF16.
    Anything else (norms, biases) becomes float32 in torch's shape."""
    from pyorch.layers.quantization.gguf import ggml_tensor

    shape = _tensor_shape(tensor)
    ggml_type = int(tensor.tensor_type)
    data = np.asarray(tensor.data)
    if ggml_type == GGMLQuantizationType.BF16:  # gguf-py hands bf16 over as raw bytes
        values = torch.from_numpy(data.view(np.uint16).copy()).view(torch.bfloat16)
        values = values.reshape(shape)
    elif ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = torch.from_numpy(data.copy()).reshape(shape)
    else:
        rows = math.prod(shape[:-1])  # 1 for a vector
        blocks = torch.from_numpy(data.copy()).reshape(rows, -1)
        if len(shape) >= 2:
            return ggml_tensor(blocks, ggml_type)
        values = _ops.ggml_dequantize(blocks, ggml_type, blocks.shape[0], shape[-1], torch.float32)
        return values.reshape(shape)
    if len(shape) >= 2:
        return ggml_tensor(values, ggml_type)
    return values.float()


def iterate_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, CPU tensor) for every weight, one at a time, as gguf_tensor makes them:
    linear and embedding weights keep their GGUF blocks (the "gguf" quantization method,
    pyorch/layers/quantization/gguf.py, computes from them)."""
    from pyorch.layers.quantization.gguf import ggml_tensor

    reader = open_gguf(path)
    arch = _field(reader, "general.architecture", None)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported")
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    model_type = GGUF_ARCHITECTURES[arch][0]
    if arch == "llama" and int(_field(reader, "llama.expert_count", 0)) > 0:
        model_type = _LLAMA_MOE[0]
    for tensor in reader.tensors:
        if model_type in _MOE_MODULE and _EXPERT_TENSOR.fullmatch(tensor.name):
            try:
                yield from _expert_tensors(tensor, model_type)
            except (ValueError, RuntimeError) as e:
                raise ValueError(f"{path}: tensor {tensor.name}: {e}") from e
            continue
        hf_name = gguf_name_to_hf(tensor.name, model_type)
        if hf_name is None:
            continue
        try:
            # The MoE router is unquantized in the model (as in vLLM): float, whatever the file.
            router = model_type in _MOE_MODULE and hf_name.endswith(".gate.weight")
            weight = _float_values(tensor) if router else gguf_tensor(tensor)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"{path}: tensor {tensor.name}: {e}") from e
        if arch in _PERMUTED_QK_ARCHITECTURES:
            # a permutation of rows: the same on float rows and on rows of blocks
            heads = {".attn_q.": num_heads, ".attn_k.": num_kv_heads}
            for part, n in heads.items():
                if part in tensor.name:
                    ggml_type = getattr(weight, "ggml_type", None)
                    weight = unpermute_qk(weight, n)
                    if ggml_type is not None:
                        weight = ggml_tensor(weight, ggml_type)
        yield hf_name, weight


def gguf_chat_template(path: str) -> str | None:
    """The ``tokenizer.chat_template`` string stored in a GGUF file, if any."""
    return _field(open_gguf(path), "tokenizer.chat_template", None)


def gguf_special_token_ids(path: str) -> dict[str, int | None]:
    """The bos/eos/unk/pad token ids stored in a GGUF file (None where the file names none)."""
    reader = open_gguf(path)
    names = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
    out: dict[str, int | None] = {}
    for role, key in names.items():
        value = _field(reader, f"tokenizer.ggml.{key}_token_id", None)
        out[role] = None if value is None else int(value)
    return out
