"""Replays the real scheduler on an offline workload with a step-cost model: how admission policies
compare when the KV cache cannot hold every request to its end (no model, no GPU).

Each step runs `Scheduler.schedule()` and `update_from_output()` as the engine does (every
scheduled prompt chunk that completes its prompt, and every decode, samples one token; requests
run to max_tokens as with ignore_eos), and costs

    a + b_row x decode rows + b_token x prompt tokens + c x context tokens the decode rows read

milliseconds. The default coefficients were fitted by hand to the step records of fp8 Llama-3-8B
1000/1000 x1000 on an H200 (bench/results/NVIDIA_H200/fp8_vs_vllm_20261129: 41.35 ms a decode
step at ~940 rows of ~1,500 tokens, 6.06 ms at ~59 rows, ~250 ms a 16,384-token prefill step),
and the KV size is that run's, 1,882,304 tokens. There this replay gave 2,003 steps for the
reservation alone (the run took 2,005) and 1,162 steps with 48 preemptions with the thin-tail
rule (the run: 1,164 and 49). Policies:

- reserve: admission keeps room for the running requests' growth (`reserve_kv_for_growth`) only;
- tail: the same, plus the thin-tail rule (`Scheduler._tail_may_overcommit`; the default);
- none: whatever fits now, relying on preemption (vLLM's policy).

    python bench/scheduler_replay.py [--num-prompts 1000] [--input-len 1000] [--output-len 1000]
        [--random-range-ratio 0] [--kv-tokens 1882304] [--policies reserve,tail,none]

Prints simulated seconds, steps, preemptions and small-batch decode steps per policy, with the
ratio of each policy's simulated output throughput to the first one's, and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from typing import Any

from pyorch.benchmarks.common import write_json
from pyorch.core.request import Request
from pyorch.core.scheduler import Scheduler
from pyorch.executor.step import ModelRunnerOutput
from pyorch.sampling_params import SamplingParams

POLICIES = {  # name -> (reserve_kv_for_growth, tail_overcommit)
    "reserve": (True, False),
    "tail": (True, True),
    "none": (False, False),
}
SMALL_BATCH = 100  # decode steps under this many rows are counted as the small-batch tail


def workload(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(prompt length, max_tokens) per request: vLLM's random dataset lengths, uniform in
    [len x (1 - ratio), len x (1 + ratio)] for both."""
    rng = random.Random(args.seed)
    r = args.random_range_ratio

    def draw(n: int) -> int:
        return max(1, round(rng.uniform(n * (1 - r), n * (1 + r))))

    return [(draw(args.input_len), draw(args.output_len)) for _ in range(args.num_prompts)]


def replay(policy: str, lengths: list[tuple[int, int]], args: argparse.Namespace) -> dict[str, Any]:
    reserve, tail = POLICIES[policy]
    sched = Scheduler(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, block_size=args.block_size,
        num_blocks=args.kv_tokens // args.block_size + 1, reserve_kv_for_growth=reserve,
        tail_overcommit=tail)
    for i, (prompt_len, max_tokens) in enumerate(lengths):
        prompt = [1 + (i * 104729 + j * 7919) % 100_000 for j in range(prompt_len)]  # no sharing
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(Request(f"r{i}", prompt, params, 0, float(i)))
    a, b_row, b_token, c_ctx = args.cost
    total_ms = 0.0
    steps = small = output_tokens = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        rows = tokens = context = 0
        ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            # schedule() has counted the step's tokens as computed already, and marked a
            # request that reaches its last token with an output placeholder: it samples.
            request = sched.requests[rid]
            before = request.num_computed_tokens - n
            samples = request.num_output_placeholders > 0
            if n == 1 and before >= request.num_prompt_tokens:
                rows += 1
                context += before + 1
            else:
                tokens += n
            ids.append(rid)
            sampled.append([7] if samples else [])
            output_tokens += int(samples)
        total_ms += a + b_row * rows + b_token * tokens + c_ctx * context
        steps += 1
        small += int(tokens == 0 and rows < SMALL_BATCH)
        sched.update_from_output(so, ModelRunnerOutput(ids, sampled, [None] * len(ids)))
    expected = sum(max_tokens for _, max_tokens in lengths)
    if output_tokens != expected:
        raise RuntimeError(f"{policy}: {output_tokens} tokens sampled, expected {expected}")
    seconds = total_ms / 1e3
    return {"policy": policy, "simulated_s": seconds, "steps": steps,
            "preemptions": sched.num_preemptions, "small_batch_decode_steps": small,
            "output_tokens": output_tokens, "output_tok_per_s": output_tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-tokens", type=int, default=1_882_304)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--cost", type=lambda s: tuple(float(v) for v in s.split(",")),
                        default=(3.7, 0.0102, 0.0144, 1.99e-5),
                        help="a,b_row,b_token,c: ms a step, a decode row, a prompt token, a "
                             "context token read (default: the H200 fp8 Llama-3-8B fit)")
    parser.add_argument("--policies", default="reserve,tail,none")
    parser.add_argument("--output-json", default=os.path.join("bench", "results", "cpu",
                                                               "scheduler_replay.json"))
    args = parser.parse_args(argv)
    if len(args.cost) != 4:
        parser.error("--cost takes four numbers: a,b_row,b_token,c")
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"--policies: unknown {unknown} (known: {', '.join(POLICIES)})")
    if args.max_model_len < args.input_len * (1 + args.random_range_ratio) + 1:
        parser.error("--max-model-len is shorter than the longest prompt")
    lengths = workload(args)
    rows = [replay(policy, lengths, args) for policy in policies]
    base = rows[0]["output_tok_per_s"]
    for row in rows:
        row["ratio_to_first"] = row["output_tok_per_s"] / base
        print(f"{row['policy']:8s} {row['simulated_s']:8.2f} s  {row['steps']:6d} steps  "
              f"{row['preemptions']:5d} preemptions  {row['small_batch_decode_steps']:5d} "
              f"small-batch decode steps  {row['output_tok_per_s']:9.0f} tok/s  "
              f"{row['ratio_to_first']:.3f}x {rows[0]['policy']}")
    args_json = {k: v for k, v in vars(args).items() if k != "output_json"}
    write_json(args.output_json, {"benchmark": "scheduler_replay", "args": args_json,
                                  "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
