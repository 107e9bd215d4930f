"""CPU microbenchmark of the scheduler's host work per engine step (no model, no torch work).

A step on the engine core's host side is `Scheduler.schedule()` then, once the step ran,
`Scheduler.update_from_output()`; with async scheduling both overlap the GPU's previous step, so
they must stay well under a decode step (~25 ms for Llama-3-8B at batch 500 on an H100). This
times both for `--batch-sizes` running requests in steady decoding (prompts of --prompt-len tokens
sharing a prefix, block size 16, prefix caching on), with a fake runner output (one token per
request), and prints microseconds per step and per request (the best of --repeats rounds: the
machine noise only ever adds).

    python bench/scheduler_step_cpu.py [--batch-sizes 64,256,1024] [--steps 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

from pyorch.core.request import Request
from pyorch.core.scheduler import Scheduler
from pyorch.executor.step import ModelRunnerOutput
from pyorch.sampling_params import SamplingParams


def measure(batch: int, prompt_len: int, steps: int, repeats: int) -> dict[str, Any]:
    block_size = 16
    max_model_len = prompt_len + steps * (repeats + 1) + 16
    num_blocks = batch * (max_model_len // block_size + 2) + 1
    sched = Scheduler(max_num_seqs=batch, max_num_batched_tokens=max(batch * prompt_len, 8192),
                      max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks,
                      target_step_ms=40.0)
    params = SamplingParams(max_tokens=max_model_len - prompt_len, ignore_eos=True)
    prefix = list(range(1, prompt_len // 2 + 1))
    for i in range(batch):
        suffix = [1000 + (i * 7919 + j) % 30000 for j in range(prompt_len - len(prefix))]
        sched.add_request(Request(f"r{i}", prefix + suffix, params, 0, float(i)))

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(ids, [[7] for _ in ids])
        t2 = time.perf_counter()
        sched.update_from_output(so, out)
        t3 = time.perf_counter()
        sched.record_step_time(so.total_num_scheduled_tokens, 20.0, so.num_decode_tokens)
        return t1 - t0, t3 - t2

    step()  # the prefill step
    sched_us, update_us = [], []
    for _ in range(repeats):
        times = [step() for _ in range(steps)]
        sched_us.append(statistics.mean(t[0] for t in times) * 1e6)
        update_us.append(statistics.mean(t[1] for t in times) * 1e6)
    assert len(sched.running) == batch
    s, u = min(sched_us), min(update_us)
    return {"batch": batch, "schedule_us": s, "update_us": u,
            "schedule_us_per_request": s / batch, "update_us_per_request": u / batch}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="64,256,1024")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-json", default=os.path.join("bench", "results", "cpu",
                                                               "scheduler_step.json"))
    args = parser.parse_args()
    rows = []
    for batch in (int(v) for v in args.batch_sizes.split(",")):
        row = measure(batch, args.prompt_len, args.steps, args.repeats)
        rows.append(row)
        print(f"batch={batch} schedule_us={row['schedule_us']:.0f} "
              f"update_us={row['update_us']:.0f} per request: "
              f"{row['schedule_us_per_request']:.2f} + {row['update_us_per_request']:.2f} us")
    doc = {"benchmark": "scheduler_step_cpu", "env": {
        "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
        "load_avg": os.getloadavg()}, "rows": rows}
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
