"""Online fp8 against bf16: how often greedy decoding gives the same tokens.

The default model (SmolLM2-135M-Instruct) or `--model` runs with the same 32 chat prompts and
greedy sampling: in bf16, with `quantization="fp8"` (vLLM's online fp8: per-tensor fp8 weights,
dynamic per-token fp8 activations in prefill; decode batches of <= 16 rows take
skinny_gemm_fp8, bf16 activations times the fp8 weights), and in float32, the reference that
says how sensitive the model's greedy text is to rounding at all (bf16 vs float32). Agreement is
the fraction of the first `--max-tokens` generated tokens (per prompt, every position compared,
also after the first difference) where two runs chose the same token. The issue's bar is >= 90%
for fp8 vs bf16.

`--simulate` adds a pure-PyTorch fp8 simulation of the same model (transformers in float32, each
decoder linear replaced by e4m3 weights with one absmax scale per merged qkv / gate_up / o / down,
activations quantized per token): if it agrees with float32 as often as the engine's fp8 does,
the kernels are right and the disagreement is the scheme's on this model.

The default model ships as a Q4_1 GGUF file; online fp8 needs float weights, so a GGUF model is
first dequantized (the gguf package) into a float32 safetensors checkpoint in a temporary folder.

    python bench/fp8_accuracy.py                 # CPU (or the GPU when there is one)
    python bench/fp8_accuracy.py --device cuda --simulate

Writes bench/results/<device name>/fp8_accuracy.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch

from pyorch.benchmarks import common

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.", "List three prime numbers.",
    "What does a CPU do?", "Give me a tip for learning to cook.",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.", "What is 12 times 7?",
    "Name a famous painting and its painter.", "How do airplanes stay in the air?",
    "Write the first line of a mystery novel.", "What is the boiling point of water?",
    "Suggest a name for a pet goldfish.", "What are the three states of matter?",
    "Summarize the story of Cinderella.", "How many continents are there?",
    "What is a noun? Give an example.", "Recommend a book for a long flight.",
    "What causes rain?", "Explain what a computer program is to a child.",
    "Who wrote Romeo and Juliet?", "What is the largest planet in our solar system?",
    "Give two reasons to exercise.", "What is the difference between weather and climate?",
    "Write a short thank-you note to a teacher.", "How does a rainbow form?",
    "What is the square root of 81?", "Describe your ideal weekend.",
    "What is gravity?", "Tell me a fun fact about octopuses.",
]
FP8_MAX = 448.0


def float_checkpoint(gguf_path: str, folder: str) -> str:
    """Dequantizes a GGUF model into a float32 HF checkpoint (config, safetensors, tokenizer)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    from pyorch.model_loader.gguf_loader import gguf_to_hf_config, iterate_gguf_weights
    from pyorch.model_loader.tokenizer import get_tokenizer

    gguf_to_hf_config(gguf_path).save_pretrained(folder)
    tensors = {}
    for name, weight in iterate_gguf_weights(gguf_path):
        ggml_type = getattr(weight, "ggml_type", None)
        if weight.dtype == torch.uint8 and ggml_type is not None:
            values = dequantize(weight.numpy(), GGMLQuantizationType(ggml_type))
            weight = torch.from_numpy(np.ascontiguousarray(values)).reshape(weight.shape[0], -1)
        tensors[name] = weight.float().contiguous()
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    get_tokenizer(gguf_path).save_pretrained(folder)
    return folder


def _generate(model: str, device: str, max_tokens: int, dtype: str, quantization: str | None
              ) -> tuple[list[list[int]], float]:
    from pyorch import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device=device, quantization=quantization, seed=0,
              max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs], elapsed


class _SimulatedFp8Linear(torch.nn.Module):
    """x @ (e4m3(w / s_w) * s_w)^T with x quantized per token the same way, in float32."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.scale = scale
        self.qweight = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        xq = (x.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        return ((xq @ self.qweight.float().t()) * xs * self.scale).to(x.dtype)


def _simulate(model: str, device: str, max_tokens: int) -> list[list[int]]:
    """Greedy tokens of transformers' float32 model with simulated fp8 decoder linears."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    for layer in hf.model.layers:
        groups = [(layer.self_attn, ["q_proj", "k_proj", "v_proj"]), (layer.self_attn, ["o_proj"]),
                  (layer.mlp, ["gate_proj", "up_proj"]), (layer.mlp, ["down_proj"])]
        for parent, names in groups:
            linears = [getattr(parent, n) for n in names]
            scale = max(lin.weight.detach().abs().max() for lin in linears) / FP8_MAX
            for name, lin in zip(names, linears, strict=True):
                setattr(parent, name, _SimulatedFp8Linear(lin.weight.detach(), scale))
    out = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, return_tensors="pt")
        ids = (ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids).to(device)
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_tokens, min_new_tokens=max_tokens)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    same = sum(x == y for r, s in zip(a, b, strict=True) for x, y in zip(r, s, strict=True))
    total = sum(len(r) for r in a)
    prefix = [next((i for i, (x, y) in enumerate(zip(r, s, strict=True)) if x != y), len(r))
              for r, s in zip(a, b, strict=True)]
    return {"token_agreement": same / total, "same_tokens": same, "tokens": total,
            "identical_outputs": sum(p == len(r) for p, r in zip(prefix, a, strict=True)),
            "common_prefix_tokens": prefix}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--simulate", action="store_true",
                        help="also run the pure-PyTorch fp8 simulation (transformers, float32)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    device = common.resolve_device(args.device)
    model = common.resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        path = float_checkpoint(model, tmp) if model.endswith(".gguf") else model
        runs, times = {}, {}
        for name, dtype, quantization in [("bf16", "bfloat16", None),
                                          ("fp8", "bfloat16", "fp8"),
                                          ("float32", "float32", None)]:
            runs[name], times[name] = _generate(path, device, args.max_tokens, dtype,
                                                quantization)
        if args.simulate:
            runs["simulated_fp8"] = _simulate(path, device, args.max_tokens)
    pairs = {"fp8_vs_bf16": ("fp8", "bf16"), "bf16_vs_float32": ("bf16", "float32"),
             "fp8_vs_float32": ("fp8", "float32")}
    if args.simulate:
        pairs["simulated_fp8_vs_float32"] = ("simulated_fp8", "float32")
        pairs["fp8_vs_simulated_fp8"] = ("fp8", "simulated_fp8")
    results = {key: agreement(runs[a], runs[b]) for key, (a, b) in pairs.items()}
    print(f"greedy agreement, {len(PROMPTS)} prompts x {args.max_tokens} tokens on {device}:")
    for key, r in results.items():
        print(f"  {key:26s} {r['token_agreement']:6.1%} ({r['same_tokens']}/{r['tokens']}), "
              f"identical outputs {r['identical_outputs']}/{len(PROMPTS)}, mean common prefix "
              f"{sum(r['common_prefix_tokens']) / len(PROMPTS):.1f}")
    print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    doc: dict[str, Any] = {
        "benchmark": "fp8_accuracy",
        "model": model,
        "num_prompts": len(PROMPTS),
        "max_tokens": args.max_tokens,
        "token_agreement": results["fp8_vs_bf16"]["token_agreement"],
        "meets_90_percent": results["fp8_vs_bf16"]["token_agreement"] >= 0.9,
        "agreement": results,
        "time_s": times,
        "env": common.environment(device),
    }
    path_json, _ = common.output_paths("fp8_accuracy", device, args.output_json)
    common.write_json(path_json, doc)


if __name__ == "__main__":
    main()
