"""The compressed-tensors pack-quantized W4A16 scheme: tiny Llama / Qwen3 checkpoints written by
the compressed-tensors package itself (its pack-quantized compressor, from scales and zero points
set on the modules), run by the engine on the CPU, against transformers on the weights that
compressed-tensors' own decompressor gives back, token for token."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from pyorch import LLM, SamplingParams

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(
        vocab_size=160, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "qwen3": lambda: Qwen3Config(
        vocab_size=160, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}
PROMPTS = [[5, 17, 99, 3, 42], [7] * 9 + [120, 33], [150, 4]]
NEW_TOKENS = 12


def _write(path: str, config, symmetric: bool, group_size: int | None):  # type: ignore[no-untyped-def]
    """Saves a compressed-tensors pack-quantized checkpoint; returns the reference model."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.08)
    strategy = "channel" if group_size is None else "group"
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group_size)
    qcfg = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"], quantization_status="calibration", format="pack-quantized")
    apply_quantization_config(model, qcfg)
    with torch.no_grad():  # round-to-nearest scales and zero points, set where the compressor
        for module in model.modules():  # reads them
            if not hasattr(module, "weight_scale"):
                continue
            w = module.weight
            gs = w.shape[1] if group_size is None else group_size
            wg = w.view(w.shape[0], -1, gs)
            if symmetric:
                s = (wg.abs().amax(-1) / 7.5).clamp_min(1e-6)
            else:
                lo, hi = wg.amin(-1).clamp_max(0), wg.amax(-1).clamp_min(0)
                s = ((hi - lo) / 15).clamp_min(1e-6)
                module.weight_zero_point.copy_((torch.round(-lo / s) - 8).clamp(-8, 7))
            module.weight_scale.copy_(s.view_as(module.weight_scale))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    compressor.decompress_model(model)  # compressed-tensors' own dequantization
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    reference.load_state_dict({k: v for k, v in model.state_dict().items()
                               if k in reference.state_dict()})
    return reference.eval()


def _greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], 1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("symmetric,group_size", [(True, 128), (False, 64), (True, None)])
def test_pack_quantized_matches_decompressed_transformers(arch: str, symmetric: bool,
                                                          group_size: int | None, tmp_path):
    path = str(tmp_path / arch)
    reference = _write(path, CONFIGS[arch](), symmetric, group_size)
    assert os.path.exists(os.path.join(path, "config.json"))
    llm = LLM(path, skip_tokenizer_init=True, dtype=torch.float32, device="cpu",
              max_model_len=128, seed=0, kv_cache_memory_bytes=16 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [_greedy(reference, p)
                                                            for p in PROMPTS]
    names = [n for n, _ in llm.llm_engine.model_runner.model.named_parameters()
             if ".layers." in n and "proj" in n]
    assert names and all(n.rsplit(".", 1)[1].startswith("w4_") for n in names), names
