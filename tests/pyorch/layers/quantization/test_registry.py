"""The quantization registry and config plumbing: names, lookups, ignore lists over merged
layers, and the checkpoint / argument agreement rules (vLLM's)."""

import pytest
import transformers

from pyorch.layers import quantization as q
from pyorch.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
from pyorch.model_loader.quant_config import resolve_quantization


def test_registry_lists_and_returns_methods():
    assert {"fp8", "compressed-tensors"} <= set(q.QUANTIZATION_METHODS)
    assert q.get_quantization_config("fp8") is Fp8Config
    with pytest.raises(ValueError, match=r"Unknown quantization method 'int3'.*compressed-tensors"):
        q.get_quantization_config("int3")


def test_registering_a_taken_name_raises():
    class Other(Fp8Config):
        pass

    with pytest.raises(ValueError, match="'fp8' is already registered by Fp8Config"):
        q.register_quantization_config("fp8")(Other)


def test_ignore_list_over_merged_layers():
    mapping = q.QuantizationConfig.packed_modules_mapping
    ignored = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
               "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.gate_proj"]
    assert q.is_layer_skipped("model.layers.0.self_attn.qkv_proj", ignored, mapping)
    assert not q.is_layer_skipped("model.layers.1.self_attn.qkv_proj", ignored, mapping)
    with pytest.raises(ValueError, match="only some are in the quantization config's ignore"):
        q.is_layer_skipped("model.layers.1.mlp.gate_up_proj", ignored, mapping)


def test_fp8_config_from_checkpoint_dicts():
    cfg = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "static",
                                 "ignored_layers": ["model.layers.0.mlp.down_proj"]})
    assert cfg.is_checkpoint_fp8_serialized and cfg.activation_scheme == "static"
    assert cfg.is_layer_skipped("model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match="unsupported activation_scheme 'per_group'"):
        Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "per_group"})
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\] is not supported"):
        Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [64, 64]})
    assert isinstance(Fp8Config().get_quant_method(_linear(), "x"), Fp8LinearMethod)


def _linear():
    from pyorch.layers.linear import ReplicatedLinear

    return ReplicatedLinear(16, 16, bias=False)


def test_resolve_quantization_rules():
    plain = transformers.LlamaConfig()
    assert resolve_quantization(plain, None) is None
    assert resolve_quantization(plain, "FP8") == "fp8"
    fp8 = transformers.LlamaConfig(quantization_config={"quant_method": "fp8"})
    assert resolve_quantization(fp8, None) == "fp8"
    with pytest.raises(ValueError, match=r"model config \(fp8\) does not match"):
        resolve_quantization(fp8, "compressed-tensors")
    ct = transformers.LlamaConfig(quantization_config={"quant_method": "compressed_tensors"})
    assert resolve_quantization(ct, None) == "compressed-tensors"
    bnb = transformers.LlamaConfig(quantization_config={"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="quantized with 'bitsandbytes', which pyorch does not"):
        resolve_quantization(bnb, None)
