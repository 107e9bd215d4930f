"""Where an engine step's host time goes: runs LLM.generate on random prompts under cProfile and
prints the hottest functions, the step count and the wall time per step.

    python bench/probes/profile_step.py --model MODEL_DIR --load-format dummy --dtype bfloat16 \
        --num-prompts 256 --input-len 128 --output-len 64 [--out DIR]

A developer's tool for finding host overhead (`pyorch bench latency` / `throughput` give the
figures to report); with --out it also writes the pstats file and the text report there.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch

from pyorch import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--top", type=int, default=45)
    args = parser.parse_args()

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(100, vocab - 100, (args.input_len,),
                                                  generator=gen).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                            temperature=args.temperature)
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()

    core = llm.llm_engine.engine_core
    steps_before = core.num_steps
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    elapsed = time.perf_counter() - start
    steps = core.num_steps - steps_before
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)

    text = io.StringIO()
    print(f"{args.num_prompts} prompts {args.input_len}/{args.output_len}: {elapsed:.2f} s "
          f"(under cProfile), {steps} steps, {1e3 * elapsed / max(steps, 1):.2f} ms/step, "
          f"{tokens / elapsed:.0f} output tok/s", file=text)
    for key in ("tottime", "cumulative"):
        print(f"\n== top {args.top} by {key}", file=text)
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(args.top)
    report = text.getvalue()
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        profiler.dump_stats(os.path.join(args.out, "profile_step.pstats"))
        with open(os.path.join(args.out, "profile_step.txt"), "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
