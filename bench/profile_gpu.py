"""GPU time against wall time of steady-state engine steps (torch.profiler): is a step bound by
the device or by the host? Fills the batch with `--num-prompts` requests, steps until every
prompt is prefilled, then profiles `--steps` decode steps and prints the kernels by GPU time,
the host ops by CPU time, and GPU busy time per step against wall time per step.

    python bench/profile_gpu.py --model MODEL_DIR --num-prompts 1000 [--output-len 128] [--out DIR]

Each request runs to --output-len tokens (the 128/128 workload's decode state by default). The
scheduler admits a request only when the KV cache can hold it to that length, so the batch is the
full --num-prompts only when they fit together; the header line says how many wait.

With --phase prefill it profiles the steps that take the prompts in instead (e.g. --input-len
2048 --max-model-len 4096: the prefill-bound 2048/128 workload).

A developer's tool (the figures to report come from `pyorch bench`); with --out it writes the
tables, a Chrome trace and the trace's critical path per kernel (bench/probes/critical_path.py:
under PDL a kernel's profiled time includes its wait on the one before) there.

With --tensor-parallel-size N the model runs in N worker processes: each rank profiles itself
(`Worker.profile` through the executor's collective_rpc) and the script prints rank 0's kernel
table (and with --out writes every rank's table and trace), next to the engine's wall time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pyorch import SamplingParams
from pyorch.engine.arg_utils import EngineArgs
from pyorch.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128,
                        help="each request's max_tokens (ignore_eos): the KV cache admits a "
                             "request only if it can hold it to this length, so a cap far past the "
                             "profiled steps leaves requests waiting (and the decode batch short); "
                             "at least 5 x --steps + 8 for the decode phase")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=True)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--quantization", default=None,
                        help="as the engine's --quantization (e.g. fp8: online dynamic fp8)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--load-format", default="dummy",
                        help="as the engine's --load-format: dummy (default: random weights of "
                             "the config's shapes) or auto (the checkpoint's own files, e.g. the "
                             "GPTQ checkpoint bench/w4a16_decode.py writes, whose g_idx a dummy "
                             "load does not fill)")
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                        help="decode: steady decode once every prompt is in; prefill: the steps "
                             "that take the prompts in (after two warm-up steps)")
    args = parser.parse_args()
    if args.phase == "decode" and args.output_len < 5 * args.steps + 8:
        parser.error(f"--output-len {args.output_len} is too short for --steps {args.steps}: the "
                     f"requests would finish inside the profiled steps (need >= "
                     f"{5 * args.steps + 8})")

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, load_format=args.load_format, dtype="bfloat16",
        skip_tokenizer_init=True,  # prompts are token ids; dummy checkpoints have no tokenizer
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype))
    vocab = engine.config.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_prompts):
        ids = torch.randint(100, vocab - 100, (args.input_len,), generator=gen).tolist()
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    scheduler = engine.scheduler
    if args.phase == "prefill":
        for _ in range(2):
            engine.step()
    else:
        while any(r.num_computed_tokens < r.num_prompt_tokens
                  for r in scheduler.requests.values()):
            engine.step()
        for _ in range(3):
            engine.step()
    torch.cuda.synchronize()
    # Unprofiled first: host time per step by phase at this batch (the profiler slows the host).
    from pyorch.benchmarks.common import format_phases
    timings = engine.engine_core.timings
    before, start = timings.snapshot(), time.perf_counter()
    plain_steps = args.steps if args.phase == "prefill" else args.steps * 4
    for _ in range(plain_steps):
        engine.step()
    torch.cuda.synchronize()
    plain_ms = 1e3 * (time.perf_counter() - start) / plain_steps
    phases = timings.per_step_ms(before)
    unprofiled = (f"unprofiled, {phases['steps']} steps: wall {plain_ms:.2f} ms/step, host (CPU) "
                  f"{phases['host']:.2f} ms/step: {format_phases(phases)}")

    if args.tensor_parallel_size > 1:
        profile_workers(engine, args, plain_ms, unprofiled)
        return
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    wall_ms = 1e3 * sum(walls) / len(walls)
    lines = [
        f"batch {len(scheduler.running)} {args.phase} ({len(scheduler.waiting)} waiting), async "
        f"{args.async_scheduling}: wall "
        f"{wall_ms:.2f} ms/step (profiled), GPU kernels {gpu_us / 1e3 / args.steps:.2f} ms/step "
        f"-> GPU busy {100 * gpu_us / 1e3 / args.steps / wall_ms:.0f}%", unprofiled,
        "", "== by GPU time",
        events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60),
        "== by CPU time",
        events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60),
    ]
    report = "\n".join(lines)
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile_gpu.txt"), "w") as f:
            f.write(report)
        trace = os.path.join(args.out, "profile_gpu_trace.json")
        prof.export_chrome_trace(trace)
        # Where the steps' device time goes when kernels overlap (PDL): each kernel charged for
        # how far it moves the latest end time (bench/probes/critical_path.py).
        probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probes",
                             "critical_path.py")
        table = subprocess.run([sys.executable, probe, trace, "--steps", str(args.steps)],
                               capture_output=True, text=True, check=True).stdout
        print("== critical path per step\n" + table)
        with open(os.path.join(args.out, "critical_path.txt"), "w") as f:
            f.write(table)


def profile_workers(engine: LLMEngine, args: argparse.Namespace, plain_ms: float,
                    unprofiled: str) -> None:
    """Every rank profiles `args.steps` steps in its worker; rank 0's table is printed."""
    executor = engine.engine_core.model_executor
    executor.collective_rpc("profile", (True,))
    walls = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    # The same call goes to every rank: each fills its rank into the trace path.
    pattern = os.path.join(args.out, "profile_gpu_trace_rank{rank}.json") if args.out else None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    tables = executor.collective_rpc("profile", (False, pattern))
    wall_ms = 1e3 * sum(walls) / len(walls)
    report = "\n".join([
        f"TP={args.tensor_parallel_size} {args.phase}, batch {len(engine.scheduler.running)}: "
        f"wall {wall_ms:.2f} ms/step (profiled); {unprofiled} (plain {plain_ms:.2f} ms/step)",
        "", "== rank 0, by GPU time", tables[0]])
    print(report)
    if args.out:
        for r, table in enumerate(tables):
            with open(os.path.join(args.out, f"profile_gpu_rank{r}.txt"), "w") as f:
                f.write(report if r == 0 else table)


if __name__ == "__main__":
    main()
