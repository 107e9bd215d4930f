"""Online fp8 quantization while the weights load (pyorch/model_loader/layerwise.py): each layer is
quantized as soon as its checkpoint tensors are in, so the float model is never whole in memory,
and the result is the one of loading everything first and quantizing after."""

from __future__ import annotations

import pytest
import torch

from pyorch.config import ModelConfig
from pyorch.layers.quantization import QuantizeMethodBase
from pyorch.model_loader import get_model
from pyorch.model_loader import layerwise as layerwise_mod
from pyorch.model_loader import loader as loader_mod
from tests.pyorch.layers.quantization.checkpoints import tiny_model

FP8 = torch.float8_e4m3fn


def _config(path: str, **kwargs) -> ModelConfig:
    config = ModelConfig(model=path, dtype=torch.bfloat16, device="cpu", quantization="fp8",
                         **kwargs)
    config.resolve()
    return config


def _save(tmp_path, arch: str, layers: int = 2) -> str:
    """A random float checkpoint of the tests' tiny config with `layers` decoder layers."""
    tiny_model(arch, num_hidden_layers=layers).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.fixture
def captured(monkeypatch):
    """Every LayerwiseQuantizer get_model makes, and every float weight it materializes."""
    made: list[layerwise_mod.LayerwiseQuantizer] = []
    reals: list[torch.nn.Parameter] = []
    init = layerwise_mod.LayerwiseQuantizer.__init__
    materialize = layerwise_mod._Layer.materialize

    def record_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    def record_materialize(self, name):
        was_meta = getattr(self.module, name).is_meta
        real = materialize(self, name)
        if was_meta:
            reals.append(real)
        return real

    monkeypatch.setattr(layerwise_mod.LayerwiseQuantizer, "__init__", record_init)
    monkeypatch.setattr(layerwise_mod._Layer, "materialize", record_materialize)
    return made, reals


def _quantized_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
            for name, p in module.named_parameters(recurse=False):
                out[f"{prefix}.{name}"] = p.detach().clone()
    return out


def _load_whole_then_quantize(config: ModelConfig, monkeypatch) -> torch.nn.Module:
    """The path before layerwise loading: every float weight allocated at construction, loaded,
    then quantized in the final pass."""
    import contextlib

    monkeypatch.setattr(loader_mod, "online_weights_on_meta", contextlib.nullcontext)
    model = get_model(config)
    monkeypatch.undo()
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_layerwise_fp8_equals_quantizing_after_the_whole_load(tmp_path, arch, captured,
                                                            monkeypatch):
    path = _save(tmp_path, arch)
    made, reals = captured
    streamed = get_model(_config(path))
    quantizer = made[-1]
    assert quantizer, "no layer took the layerwise path"
    kinds = {type(layer.module).__name__ for layer in quantizer.layers}
    assert "QKVParallelLinear" in kinds
    if arch == "qwen3_moe":
        assert "FusedMoE" in kinds
    whole = _load_whole_then_quantize(_config(path), monkeypatch)
    a, b = _quantized_params(streamed), _quantized_params(whole)
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8) if a[name].dtype == FP8 else a[name],
                           b[name].view(torch.uint8) if b[name].dtype == FP8 else b[name]), name
    assert any(t.dtype == FP8 for t in a.values())
    # Every float weight that was materialized has given its storage back, although the model's
    # loader held the parameter objects in its dict for the whole loop.
    assert reals and all(r.numel() == 0 for r in reals)


def test_layerwise_peak_is_one_decoder_layer(tmp_path, captured):
    """A checkpoint stored in layer order keeps at most one decoder layer's float weights in
    memory (of 4 here), where quantizing after the load held all of them."""
    path = _save(tmp_path, "llama", layers=4)
    made, _ = captured
    get_model(_config(path))
    quantizer = made[-1]
    per_layer: dict[str, int] = {}
    for layer in quantizer.layers:
        decoder = ".".join(layer.prefix.split(".")[:3])  # model.layers.N
        per_layer[decoder] = per_layer.get(decoder, 0) + sum(
            n * 2 for n in layer.total.values())  # bf16
    assert len(per_layer) == 4
    total = sum(per_layer.values())
    assert 0 < quantizer.peak_float_bytes <= max(per_layer.values()) < total / 3
    assert quantizer.live_float_bytes == 0


def test_layerwise_dummy_weights_quantize_layer_by_layer(tmp_path, captured):
    path = _save(tmp_path, "qwen3_moe")
    made, reals = captured
    model = get_model(_config(path, load_format="dummy"))
    quantizer = made[-1]
    assert all(layer.done for layer in quantizer.layers)
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == FP8 and bool((experts.w13_weight_scale > 0).all())
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and float(qkv.weight.float().abs().max()) > 0
    largest = max(sum(n * 2 for n in layer.total.values()) for layer in quantizer.layers)
    assert quantizer.peak_float_bytes == largest  # one layer at a time
    assert reals and all(r.numel() == 0 for r in reals)


def test_layerwise_missing_weight_raises_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _save(tmp_path, "llama", layers=2)
    weights = load_file(f"{path}/model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        get_model(_config(path))


def test_layer_built_by_hand_keeps_real_weights():
    """Outside get_model (no online_weights_on_meta), an online fp8 layer allocates its float
    weight as before, so code that builds layers directly keeps working."""
    from pyorch.layers.linear import ColumnParallelLinear
    from pyorch.layers.quantization.fp8 import Fp8Config

    with torch.device("cpu"):
        layer = ColumnParallelLinear(64, 32, bias=False, quant_config=Fp8Config(),
                                     params_dtype=torch.bfloat16)
    assert not layer.weight.is_meta and layer.weight.dtype == torch.bfloat16


def test_duplicate_tensor_after_completion_raises(tmp_path):
    """A checkpoint tensor arriving for a layer already quantized is an error, not a silent
    overwrite of freed storage."""
    from pyorch.layers.quantization import online_weights_on_meta
    from pyorch.layers.linear import ColumnParallelLinear
    from pyorch.layers.quantization.fp8 import Fp8Config
    from pyorch.model_loader.layerwise import LayerwiseQuantizer

    with torch.device("cpu"), online_weights_on_meta():
        model = torch.nn.Sequential(ColumnParallelLinear(64, 32, bias=False,
                                                         quant_config=Fp8Config(),
                                                         params_dtype=torch.bfloat16))
    meta = model[0].weight
    assert meta.is_meta
    quantizer = LayerwiseQuantizer(model, torch.device("cpu"))
    w = torch.randn(32, 64)
    with torch.no_grad():
        meta.weight_loader(meta, w)
    assert model[0].weight.dtype == FP8 and quantizer.layers[0].done
    with pytest.raises(RuntimeError, match=r"0\.weight: a checkpoint tensor arrived after"):
        meta.weight_loader(meta, w)
