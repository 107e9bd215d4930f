"""Online fp8 against bf16: how often greedy decoding gives the same tokens.

The default model (SmolLM2-135M-Instruct) or `--model` runs twice with the same 32 chat prompts
and greedy sampling: once in bf16, once with `quantization="fp8"` (vLLM's online fp8: per-tensor
fp8 weights, dynamic per-token fp8 activations, bf16 elsewhere). Agreement is the fraction of the
first `--max-tokens` generated tokens (per prompt, up to the first difference and after: every
position compared) where the two runs chose the same token; a prompt agrees fully when all of its
tokens do. The issue's bar is >= 90%.

    python bench/fp8_accuracy.py                 # CPU (or the GPU when there is one)
    python bench/fp8_accuracy.py --device cuda

Writes bench/results/<device name>/fp8_accuracy.json.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

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


def _generate(model: str, device: str, max_tokens: int, quantization: str | None
              ) -> tuple[list[list[int]], float]:
    from pyorch import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", device=device, quantization=quantization, seed=0,
              max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return [list(o.outputs[0].token_ids) for o in outputs], elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    device = common.resolve_device(args.device)
    model = common.resolve_model(args.model)
    bf16, bf16_s = _generate(model, device, args.max_tokens, None)
    fp8, fp8_s = _generate(model, device, args.max_tokens, "fp8")
    same = sum(a == b for x, y in zip(bf16, fp8, strict=True) for a, b in zip(x, y, strict=True))
    total = sum(len(x) for x in bf16)
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
              for x, y in zip(bf16, fp8, strict=True)]
    agreement = same / total
    full = sum(p == args.max_tokens for p in prefix)
    print(f"fp8 vs bf16 greedy, {len(PROMPTS)} prompts x {args.max_tokens} tokens on {device}: "
          f"token agreement {agreement:.1%} ({same}/{total}), identical outputs {full}/"
          f"{len(PROMPTS)}, mean common prefix {sum(prefix) / len(prefix):.1f} tokens")
    print(f"time: bf16 {bf16_s:.1f} s, fp8 {fp8_s:.1f} s")
    doc: dict[str, Any] = {
        "benchmark": "fp8_accuracy",
        "model": model,
        "num_prompts": len(PROMPTS),
        "max_tokens": args.max_tokens,
        "token_agreement": agreement,
        "identical_outputs": full,
        "common_prefix_tokens": prefix,
        "meets_90_percent": agreement >= 0.9,
        "time_s": {"bf16": bf16_s, "fp8": fp8_s},
        "env": common.environment(device),
    }
    path, _ = common.output_paths("fp8_accuracy", device, args.output_json)
    common.write_json(path, doc)


if __name__ == "__main__":
    main()
