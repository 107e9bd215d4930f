"""Fp8MoEMethod: fp8 experts of a FusedMoE layer (online quantization of bf16 weights, and per-
tensor fp8 checkpoints with vLLM's w13_weight_scale / w2_weight_scale / w13_input_scale names),
against the float64 layer on the dequantized weights; the refusals (block-wise experts, non-bf16
models); and a tiny Qwen3-MoE engine with --quantization fp8."""

import pytest
import torch

from pyorch import LLM, SamplingParams, _ops
from pyorch.layers.fused_moe import FusedMoE
from pyorch.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod
from tests.pyorch.layers.quantization.checkpoints import tiny_model
from tests.reference import moe as ref

E, TOP_K, H, INTER = 8, 2, 64, 48
FP8 = torch.float8_e4m3fn


def _experts() -> list[dict[str, torch.Tensor]]:
    return [{"w1": torch.randn(INTER, H) / H**0.5, "w3": torch.randn(INTER, H) / H**0.5 * 3,
             "w2": torch.randn(H, INTER) / INTER**0.5} for _ in range(E)]


def _reference(layer: FusedMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The float64 layer on the dequantized fp8 weights the layer holds."""
    w13 = layer.w13_weight.double() * layer.w13_weight_scale.double()[:, None, None]
    w2 = layer.w2_weight.double() * layer.w2_weight_scale.double()[:, None, None]
    weights, ids = ref.topk_softmax(logits, TOP_K, renormalize=True)
    return ref.fused_moe(x, w13, w2, weights, ids)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # The activations' per-tensor fp8 rounding (3 mantissa bits) is the only difference.
    peak = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, atol=0.05 * peak, rtol=0.1)


def test_online_fp8_experts():
    config = Fp8Config(is_checkpoint_fp8_serialized=False)
    layer = FusedMoE(E, TOP_K, H, INTER, params_dtype=torch.bfloat16, quant_config=config,
                     prefix="model.layers.0.mlp.experts")
    assert isinstance(layer.quant_method, Fp8MoEMethod)
    experts = _experts()
    for e, mats in enumerate(experts):
        for shard, w in mats.items():
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            param.weight_loader(param, w.to(torch.bfloat16), f"experts.{e}.{shard}", shard, e)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.w13_weight.dtype == FP8 and layer.w2_weight.dtype == FP8
    assert layer.w13_weight_scale.shape == (E,) and layer.w2_weight_scale.shape == (E,)
    # One scale per expert over gate and up: the absmax of the bf16 weights / 448.
    want_scale = torch.stack([torch.cat([m["w1"], m["w3"]]).to(torch.bfloat16).float().abs()
                              .max() / _ops.FP8_MAX for m in experts])
    torch.testing.assert_close(layer.w13_weight_scale, want_scale)
    x = torch.randn(37, H).to(torch.bfloat16)
    logits = torch.randn(37, E)
    out = layer(x, logits)
    assert out.dtype == torch.bfloat16
    _close(out, _reference(layer, x, logits))
    # ... and the dequantized weights are the float ones to fp8 precision.
    deq = layer.w13_weight.float() * layer.w13_weight_scale[:, None, None]
    w13 = torch.stack([torch.cat([m["w1"], m["w3"]]) for m in experts])
    assert (deq - w13).abs().max() <= 0.07 * w13.abs().max()


@pytest.mark.parametrize("static", [False, True])
def test_fp8_checkpoint_experts(static: bool):
    """Per-tensor fp8 checkpoint tensors per expert and shard: gate and up are requantized to
    their max scale; static input scales fold to their max."""
    config = Fp8Config(is_checkpoint_fp8_serialized=True,
                       activation_scheme="static" if static else "dynamic")
    layer = FusedMoE(E, TOP_K, H, INTER, params_dtype=torch.bfloat16, quant_config=config)
    assert layer.w13_weight.dtype == FP8 and layer.w13_weight_scale.shape == (E, 2)
    deq: dict[tuple[int, str], torch.Tensor] = {}
    for e, mats in enumerate(_experts()):
        for shard, w in mats.items():
            scale = w.abs().max() / _ops.FP8_MAX
            q = (w / scale).to(FP8)
            deq[(e, shard)] = q.double() * scale.double()
            name = "w2" if shard == "w2" else "w13"
            for kind, t in (("weight", q), ("weight_scale", scale.reshape(1)),
                            ("input_scale", torch.tensor([0.01 * (e + 1)]))):
                if kind == "input_scale" and not static:
                    continue
                param = getattr(layer, f"{name}_{kind}")
                param.weight_loader(param, t, f"experts.{e}.{shard}.{kind}", shard, e)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.w13_weight_scale.shape == (E,)
    if static:
        assert layer.w13_input_scale.tolist() == pytest.approx([0.01 * E])
    # The requantized gate (its scale was smaller) still dequantizes to the checkpoint's values.
    for e in range(E):
        got = layer.w13_weight[e].double() * layer.w13_weight_scale[e].double()
        want = torch.cat([deq[(e, "w1")], deq[(e, "w3")]])
        assert (got - want).abs().max() <= 0.07 * want.abs().max()
    x = torch.randn(29, H).to(torch.bfloat16) * 0.1
    logits = torch.randn(29, E)
    _close(layer(x, logits), _reference(layer, x, logits))


def test_missing_checkpoint_scale_is_an_error():
    layer = FusedMoE(E, TOP_K, H, INTER, params_dtype=torch.bfloat16,
                     quant_config=Fp8Config(is_checkpoint_fp8_serialized=True))
    with pytest.raises(ValueError, match="has no w13_weight_scale for some expert"):
        layer.quant_method.process_weights_after_loading(layer)
    with pytest.raises(ValueError, match="expected one per-tensor scale"):
        layer.w2_weight_scale.weight_loader(layer.w2_weight_scale, torch.ones(4), "x", "w2", 0)


def test_refusals():
    with pytest.raises(NotImplementedError, match="block-wise .*mixture-of-experts"):
        FusedMoE(E, TOP_K, H, INTER, params_dtype=torch.bfloat16,
                 quant_config=Fp8Config(True, weight_block_size=[128, 128]))
    with pytest.raises(ValueError, match="take bfloat16 activations.*float32"):
        FusedMoE(E, TOP_K, H, INTER, params_dtype=torch.float32, quant_config=Fp8Config())
    # A skipped layer stays unquantized.
    layer = FusedMoE(E, TOP_K, H, INTER, params_dtype=torch.bfloat16,
                     quant_config=Fp8Config(ignored_layers=["mlp.experts"]), prefix="mlp.experts")
    assert layer.quant_method is None and layer.w13_weight.dtype == torch.bfloat16


def test_online_fp8_qwen3_moe_engine(tmp_path):
    """--quantization fp8 on a bf16 Qwen3-MoE: the experts hold fp8 weights, and the first
    token's top logprobs stay close to the bf16 engine's."""
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, model.config.vocab_size, (n,),
                                                  generator=gen).tolist()} for n in (5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    tops = {}
    for quantization in (None, "fp8"):
        llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype=torch.bfloat16, device="cpu",
                  max_model_len=256, kv_cache_memory_bytes=16 << 20, seed=0,
                  quantization=quantization)
        if quantization:
            experts = llm.llm_engine.model_runner.model.model.layers[0].mlp.experts
            assert isinstance(experts.quant_method, Fp8MoEMethod)
            assert experts.w13_weight.dtype == FP8 and experts.w2_weight_scale.shape == (4,)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tops[quantization] = [o.outputs[0].logprobs[0] for o in outs]
    diffs, agree = [], 0
    for want, got in zip(tops[None], tops["fp8"], strict=True):
        common = [t for t in want if t in got]
        assert len(common) >= 10
        diffs += [abs(want[t].logprob - got[t].logprob) for t in common]
        agree += max(want, key=lambda t: want[t].logprob) == max(got, key=lambda t: got[t].logprob)
    # Every weight (attention, experts) and activation in fp8 vs bf16: tenths of a logprob
    # (0.19 measured; 0.17 of it with the experts left in bf16).
    assert sum(diffs) / len(diffs) < 0.25 and agree >= len(prompts) - 1, diffs


def _write_per_tensor_fp8(path: str) -> str:
    """A per-tensor fp8 checkpoint (`quant_method: fp8`, AutoFP8's layout): every projection,
    each expert's included, as float8_e4m3fn with a scalar `weight_scale` = absmax / 448; and
    beside it (path + "_deq") the float checkpoint those tensors dequantize to."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    tiny_model("qwen3_moe").save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("proj.weight") and "mlp.gate." not in name:
            scale = t.float().abs().max() / _ops.FP8_MAX
            q = (t.float() / scale).to(FP8)
            quantized[name] = q
            quantized[name.removesuffix(".weight") + ".weight_scale"] = scale.reshape(())
            dequantized[name] = (q.float() * scale).to(t.dtype)
        else:
            quantized[name] = dequantized[name] = t
    tiny_model("qwen3_moe").save_pretrained(path + "_deq")
    save_file(dequantized, os.path.join(path + "_deq", "model.safetensors"),
              metadata={"format": "pt"})
    save_file(quantized, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def test_per_tensor_fp8_qwen3_moe_checkpoint(tmp_path):
    """The model loader routes each expert's weight_scale to w13_weight_scale / w2_weight_scale;
    the engine's first-token logprobs stay close to the dequantized float checkpoint's."""
    path = _write_per_tensor_fp8(str(tmp_path / "fp8"))
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=gen).tolist()}
               for n in (6, 23, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    tops = {}
    for p in (path, path + "_deq"):
        llm = LLM(p, skip_tokenizer_init=True, dtype=torch.bfloat16, device="cpu",
                  max_model_len=256, kv_cache_memory_bytes=16 << 20, seed=0)
        if p == path:
            experts = llm.llm_engine.model_runner.model.model.layers[1].mlp.experts
            assert experts.w13_weight.dtype == FP8 and experts.w13_weight_scale.shape == (4,)
        tops[p] = [o.outputs[0].logprobs[0] for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)]
    diffs, agree = [], 0
    for want, got in zip(tops[path + "_deq"], tops[path], strict=True):
        common = [t for t in want if t in got]
        assert len(common) >= 10
        diffs += [abs(want[t].logprob - got[t].logprob) for t in common]
        agree += max(want, key=lambda t: want[t].logprob) == max(got, key=lambda t: got[t].logprob)
    # Same weights; only the activations' fp8 rounding differs.
    assert sum(diffs) / len(diffs) < 0.2 and agree >= len(prompts) - 1, diffs


def test_dummy_weights_of_a_per_tensor_fp8_moe_checkpoint(tmp_path):
    """--load-format dummy on an fp8 checkpoint's config (how a 235B-class fp8 MoE is
    benchmarked without its weights, both engines allocating fp8 directly): the dummy scales are
    positive, so the load-time re-quantization of each expert's gate/up pair runs, and the
    engine generates."""
    import os
    import shutil

    path = _write_per_tensor_fp8(str(tmp_path / "fp8"))
    os.remove(os.path.join(path, "model.safetensors"))  # dummy never reads the weights
    shutil.rmtree(path + "_deq")
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype=torch.bfloat16,
              device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20, seed=0)
    model = llm.llm_engine.model_runner.model
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == FP8 and bool((experts.w13_weight_scale > 0).all())
    scales = [p for n, p in model.named_parameters() if n.endswith("scale")]
    assert scales and all(bool((p > 0).all()) for p in scales)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
