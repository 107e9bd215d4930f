"""Where a batch-1 prefill-only request's wall time goes (`LLM.generate(max_tokens=1)` on a fresh
prompt): 54.7 ms for a 128-token Llama-3-8B fp8 prompt on an H200, against ~2 ms of weight reads.

    python bench/probes/request_round_trip.py --model MODEL [--quantization fp8 --kv-cache-dtype fp8]
        [--input-len 128] [--iters 5] [--out DIR]

Prints the median request wall time, the wall time of each engine step inside one request (with
the engine's own phase timings), then a cProfile of one request (Python functions by own and by
cumulative time) and a torch.profiler table of another (host ops by CPU time, kernels by GPU
time). Every request gets a new random prompt and the prefix cache is reset before it, so each
one prefills from scratch as the latency benchmark's prefill-only run does.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pyorch import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--max-num-seqs", type=int, default=1,
                        help="1 (default, the figures in its results): mixed-batch CUDA graphs "
                             "stop at 2 tokens, so the prompt prefills eagerly; leave the engine "
                             "default with 0")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    llm = LLM(args.model, load_format=args.load_format, dtype="bfloat16", device=args.device,
              max_model_len=args.max_model_len, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs or None)
    vocab = llm.llm_engine.config.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)

    def one_request() -> float:
        ids = torch.randint(100, vocab - 100, (args.input_len,), generator=gen).tolist()
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(2):
        one_request()
    walls = [one_request() for _ in range(args.iters)]
    lines = [f"prefill-only request, {args.input_len} tokens: median "
             f"{statistics.median(walls) * 1e3:.2f} ms over {args.iters} "
             f"({', '.join(f'{w * 1e3:.1f}' for w in walls)})"]

    # Each engine step's wall time within one request, with the engine's phase timings.
    engine = llm.llm_engine
    core = engine.engine_core
    step_walls: list[float] = []
    real_step = engine.step

    def timed_step():  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = real_step()
        step_walls.append(time.perf_counter() - start)
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    before = core.timings.snapshot()
    wall = one_request()
    phases = core.timings.per_step_ms(before)
    engine.step = real_step  # type: ignore[method-assign]
    lines.append(f"one request {wall * 1e3:.2f} ms = {len(step_walls)} steps: "
                 f"{', '.join(f'{w * 1e3:.2f}' for w in step_walls)} ms; outside steps "
                 f"{(wall - sum(step_walls)) * 1e3:.2f} ms")
    lines.append("engine phases per step (ms): " + ", ".join(
        f"{k} {v:.2f}" for k, v in phases.items() if k != "steps"))

    prof_py = cProfile.Profile()
    ids = torch.randint(100, vocab - 100, (args.input_len,), generator=gen).tolist()
    llm.reset_prefix_cache()
    prof_py.enable()
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    prof_py.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof_py, stream=buf).sort_stats(key).print_stats(30)
        lines += ["", f"== cProfile by {key}", buf.getvalue()]

    ids = torch.randint(100, vocab - 100, (args.input_len,), generator=gen).tolist()
    llm.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    lines += ["", f"== torch.profiler: GPU kernels {gpu_us / 1e3:.2f} ms in one request",
              "== by CPU time",
              events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70),
              "== by GPU time",
              events.table(sort_by="self_device_time_total", row_limit=30,
                           max_name_column_width=70)]
    report = "\n".join(lines)
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "request_round_trip.txt"), "w") as f:
            f.write(report)
        prof.export_chrome_trace(os.path.join(args.out, "request_round_trip_trace.json"))


if __name__ == "__main__":
    main()
