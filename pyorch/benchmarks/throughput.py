"""`pyorch bench throughput`: offline throughput of `LLM.generate` against transformers `generate`.

The workload (nano-vllm's bench.py, vLLM's random dataset): `--num-prompts` prompts of random
token ids, `--input-len` long, `max_tokens=--output-len` (both uniform in [len*(1-r), len*(1+r)]
with `--random-range-ratio r`, vLLM's semantics), fixed `--seed`, `ignore_eos=True`, after a
warm-up. `--dataset-name prefix_repetition` (vLLM's) and `longtail` (log-normal lengths) are the
other workloads (`pyorch.benchmarks.datasets`). transformers generates one output length per
batch, so a workload whose output lengths vary runs with `--skip-hf`.

Baseline, measured in the same run on the same prompts, model, dtype and device: transformers
`generate` (greedy, min_new_tokens = max_new_tokens = output_len, left padding) at each batch size
in `--hf-batch-sizes`. pyorch runs at the same batch sizes (`max_num_seqs` = the batch size, all
prompts submitted at once), so "batch 1" and "batch 16" compare like with like. `--hf-best`
instead compares pyorch at its own `max_num_seqs` with transformers at its best batch size.

transformers is slow on long outputs (1000/1000 at 1000 prompts would take it an hour): the rate
is what compares, so `--hf-num-prompts N` times it on the first N prompts only, and
`--hf-probe-sizes` names the batch sizes `--hf-best` tries. Where the best probe already ran
exactly those N prompts at that batch size, its timing is the row (the same run again would
only repeat it).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any, Optional

from pyorch.benchmarks import common, datasets
from pyorch.metrics.stats import GcPauses, format_step_trace, summarize_step_trace

NAME = "throughput"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    parser.add_argument("--output-len", type=int, default=128, help="new tokens per request")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="random dataset: prompt and output lengths uniform in "
                             "[L*(1-r), L*(1+r)]")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="pyorch's sampling temperature (default 0: greedy, as the "
                             "transformers baseline; vLLM's `bench throughput` samples at 1.0, "
                             "top_p 1.0)")
    parser.add_argument("--hf-batch-sizes", type=common.parse_int_list, default=[1, 16],
                        help="comma-separated batch sizes run by both engines (default 1,16)")
    parser.add_argument("--hf-best", action="store_true",
                        help="compare pyorch at its own max_num_seqs with transformers at its "
                             "best batch size (powers of two up to --hf-max-batch-size)")
    parser.add_argument("--hf-max-batch-size", type=int, default=256)
    parser.add_argument("--hf-probe-sizes", type=common.parse_int_list, default=None,
                        help="batch sizes --hf-best tries (default powers of two up to "
                             "--hf-max-batch-size)")
    parser.add_argument("--hf-num-prompts", type=int, default=None,
                        help="transformers runs the first N prompts only (default all); "
                             "its rate is compared")
    parser.add_argument("--skip-hf", action="store_true", help="run pyorch only")
    parser.add_argument("--num-repeats", type=int, default=1,
                        help="timed runs per engine and batch size; rows report the median")
    parser.add_argument("--disable-detokenize", action="store_true",
                        help="pyorch returns token ids only (transformers never detokenizes)")
    parser.add_argument("--output-json", default=None,
                        help="result file (default bench/results/<device>/throughput.json)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--step-trace", action="store_true",
                        help="record every step of pyorch's first run on CUDA (device busy and "
                             "idle time from CUDA events, host time) into the JSON")
    datasets.add_dataset_args(parser)
    common.add_engine_args(parser)


def _row(engine: str, batch_size: int, num_requests: int, elapsed: float, input_tokens: int,
         output_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "engine": engine, "batch_size": batch_size, "num_requests": num_requests,
        "elapsed_s": elapsed, "input_tokens": input_tokens, "output_tokens": output_tokens,
        "requests_per_s": num_requests / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed,
        **extra,
    }


class PyorchRunner:
    """One LLM built with max_num_seqs (None: the engine default) and warmed up; each `run`
    submits all prompts at once."""

    def __init__(self, args: argparse.Namespace, model: str, device: str,
                 warmup_prompts: list[list[int]], max_num_seqs: Optional[int]):
        from pyorch import LLM, SamplingParams

        overrides: dict[str, Any] = {"device": device}
        if max_num_seqs is not None:
            overrides["max_num_seqs"] = max_num_seqs
        self.llm = LLM(model, **common.engine_kwargs(args, **overrides))
        config = self.llm.llm_engine.config
        self.batch_size = config.scheduler_config.max_num_seqs
        self.dtype = config.model_config.dtype
        detok = not args.disable_detokenize
        self.step_trace = args.step_trace
        self.output_lens: list[int] = []  # per prompt, set by measure()
        self.params = SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                                     temperature=args.temperature, top_p=1.0,
                                     detokenize=detok)
        warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0, detokenize=detok)
        self.llm.generate([{"prompt_token_ids": p} for p in warmup_prompts], warm, use_tqdm=False)

    def run(self, prompts: list[list[int]]) -> dict[str, Any]:
        self.llm.reset_prefix_cache()  # repeats must prefill again, not hit the prefix cache
        core = self.llm.llm_engine.engine_core
        before = core.timings.snapshot()
        preemptions_before = core.scheduler.num_preemptions
        if self.step_trace:
            core.timings.trace = []
        with GcPauses() as gc_pauses:
            core.timings.gc_pauses = gc_pauses if self.step_trace else None
            start = time.perf_counter()
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                        self._params(len(prompts)), use_tqdm=False)
            end = time.perf_counter()
        core.timings.gc_pauses = None
        elapsed = end - start
        trace = core.timings.trace
        core.timings.trace = None
        phases = core.timings.per_step_ms(before)
        output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        expected = sum(self.output_lens[:len(prompts)])
        if output_tokens != expected:
            raise RuntimeError(f"pyorch generated {output_tokens} tokens, expected {expected}")
        # Recomputed prefills after a preemption (KV cache full) are work the GPU does twice.
        sample = {"elapsed_s": elapsed, "output_tokens": output_tokens,
                  "engine_steps": phases["steps"], "host_ms_per_step": phases["host"],
                  "step_phases_ms": phases,
                  "preemptions": core.scheduler.num_preemptions - preemptions_before,
                  "cascade_steps": core.timings.cascade_steps - before.cascade_steps,
                  "gc_pause_s": gc_pauses.total_s,
                  "gc_full_collections": gc_pauses.full_collections}
        if trace:  # the first run only
            self.step_trace = False
            sample["step_trace"] = summarize_step_trace(trace, start, end)
            sample["step_trace_records"] = [
                {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                for r in trace]
            print(f"  step trace: {format_step_trace(sample['step_trace'])}")
        return sample

    def _params(self, num: int) -> Any:
        """One SamplingParams per prompt: max_tokens from the workload's output lengths."""
        from dataclasses import replace

        if len(set(self.output_lens[:num])) == 1:
            return replace(self.params, max_tokens=self.output_lens[0])
        return [replace(self.params, max_tokens=n) for n in self.output_lens[:num]]

    def close(self) -> None:
        import torch

        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next engine sizes its KV cache from free memory


class HFRunner:
    """The transformers model (same model, dtype, device), warmed up."""

    def __init__(self, args: argparse.Namespace, model: str, device: str, dtype: Any,
                 warmup_prompts: list[list[int]]):
        from pyorch.benchmarks.hf_baseline import load_hf_model, warm_up

        start = time.perf_counter()
        self.model, how = load_hf_model(model, args.load_format or "auto", dtype, device,
                                        args.seed or 0)
        self.info: dict[str, Any] = {"hf_loader": how, "hf_load_s": time.perf_counter() - start}
        self.device, self.output_len, self.dtype = device, args.hf_output_len, dtype
        warm_up(self.model, warmup_prompts[0], device)

    def run(self, prompts: list[list[int]], batch_size: int) -> dict[str, Any]:
        from pyorch.benchmarks.hf_baseline import hf_generate

        return hf_generate(self.model, prompts, self.output_len, batch_size, self.device)

    def best_batch_size(self, prompts: list[list[int]], max_size: int,
                        sizes: Optional[list[int]] = None) -> tuple[int, dict[str, Any]]:
        """Probes `sizes` (default powers of two up to max_size), one batch each, in increasing
        order until out of memory; the fastest wins. Returns its size and its timing."""
        import torch

        if sizes is None:
            sizes = [1 << k for k in range(max_size.bit_length()) if 1 << k <= max_size]
        sizes = sorted(s for s in set(sizes) if 1 <= s <= len(prompts))
        if not sizes:
            raise ValueError(f"no transformers probe size fits {len(prompts)} prompts")
        probes, timings = [], {}
        for size in sizes:
            try:
                t = self.run(prompts[:size], size)
            except torch.OutOfMemoryError:
                gc.collect()
                torch.cuda.empty_cache()
                break
            timings[size] = t
            probes.append({"batch_size": size,
                           "output_tokens_per_s": t["output_tokens"] / t["elapsed_s"]})
            print(f"  transformers probe batch {size}: "
                  f"{probes[-1]['output_tokens_per_s']:.1f} output tok/s")
        if not probes:
            raise RuntimeError(f"transformers ran out of memory at batch size {sizes[0]}")
        self.info["hf_probes"] = probes
        best = max(probes, key=lambda p: p["output_tokens_per_s"])["batch_size"]
        return best, timings[best]

    def close(self) -> None:
        del self.model
        gc.collect()


def _summarize(engine: str, batch_size: int, prompts: list[list[int]],
               samples: list[dict[str, Any]], dtype: Any) -> dict[str, Any]:
    """One row from repeated runs: the median elapsed time, every sample kept."""
    times = [s["elapsed_s"] for s in samples]
    row = _row(engine, batch_size, len(prompts), common.median(times), sum(map(len, prompts)),
               samples[0]["output_tokens"], dtype=str(dtype))
    row["elapsed_s_all"] = times
    if "engine_steps" in samples[0]:  # pyorch: steps and CPU time per step (not blocked on
        row["engine_steps"] = samples[0]["engine_steps"]  # the device), from the first run
        row["host_ms_per_step"] = samples[0]["host_ms_per_step"]
        row["step_phases_ms"] = samples[0]["step_phases_ms"]
        row["preemptions"] = samples[0]["preemptions"]
        row["cascade_steps"] = samples[0]["cascade_steps"]
        row["gc_pause_s"] = samples[0]["gc_pause_s"]
        for key in ("step_trace", "step_trace_records"):
            if key in samples[0]:
                row[key] = samples[0][key]
    print(_format_row(row))
    return row


def measure(args: argparse.Namespace, model: str, device: str, prompts: list[list[int]],
            warmup_prompts: list[list[int]],
            output_lens: list[int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """All rows. On the CPU every engine is built first and the runs are interleaved (pyorch,
    transformers, per batch size, per repeat), so load from other processes hits both alike; on
    a GPU each pyorch engine takes the device in turn, then transformers does."""
    import torch

    sizes: list[Optional[int]] = [args.max_num_seqs] if args.hf_best else list(args.hf_batch_sizes)
    interleave = device == "cpu"
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    engines: dict[int, PyorchRunner] = {}
    dtype = None

    def record(engine: str, size: int, sample: dict[str, Any]) -> None:
        samples.setdefault((engine, size), []).append(sample)
        extra = ""
        if "engine_steps" in sample:
            extra = (f", {sample['engine_steps']} steps, CPU "
                     f"{sample['host_ms_per_step']:.2f} ms/step: "
                     f"{common.format_phases(sample['step_phases_ms'])}; "
                     f"{sample['preemptions']} preemptions, "
                     f"{sample['cascade_steps']} cascade steps")
        print(f"  {engine} batch {size}: {sample['elapsed_s']:.2f} s{extra}", flush=True)

    for size in sizes:
        runner = PyorchRunner(args, model, device, warmup_prompts, size)
        runner.output_lens = output_lens
        dtype = runner.dtype
        if interleave:
            engines[runner.batch_size] = runner
            continue
        for _ in range(args.num_repeats):
            record("pyorch", runner.batch_size, runner.run(prompts))
        runner.close()
    info: dict[str, Any] = {"interleaved": interleave, "num_repeats": args.num_repeats}
    hf = None
    hf_sizes: list[int] = []
    hf_prompts = prompts[:args.hf_num_prompts] if args.hf_num_prompts else prompts
    if not args.skip_hf:
        hf = HFRunner(args, model, device, dtype or torch.float32, warmup_prompts)
        info["hf_num_prompts"] = len(hf_prompts)
        if args.hf_best:
            best, probe = hf.best_batch_size(hf_prompts, args.hf_max_batch_size,
                                             args.hf_probe_sizes)
            hf_sizes = [best]
            if best == len(hf_prompts) and best not in engines:
                record("transformers", best, probe)  # that probe was this very run
        else:
            hf_sizes = list(args.hf_batch_sizes)
    for _ in range(args.num_repeats):
        for size, runner in engines.items():  # CPU: pyorch then transformers, size by size
            record("pyorch", size, runner.run(prompts))
            if hf is not None and size in hf_sizes:
                record("transformers", size, hf.run(hf_prompts, size))
        for size in hf_sizes:
            if size in engines:  # run above
                continue
            if len(samples.get(("transformers", size), [])) < args.num_repeats:
                assert hf is not None  # hf_sizes is empty without it
                record("transformers", size, hf.run(hf_prompts, size))
    for runner in engines.values():
        runner.close()
    if hf is not None:
        info.update(hf.info)
        hf.close()
    rows = [_summarize(engine, size, hf_prompts if engine == "transformers" else prompts, s, dtype)
            for (engine, size), s in sorted(samples.items())]
    return rows, info


def _format_row(r: dict[str, Any]) -> str:
    return (f"{r['engine']:>12} batch {r['batch_size']:>4}: {r['elapsed_s']:8.2f} s  "
            f"{r['requests_per_s']:8.3f} req/s  {r['output_tokens_per_s']:9.1f} output tok/s  "
            f"{r['total_tokens_per_s']:9.1f} total tok/s")


def compare(rows: list[dict[str, Any]], hf_best: bool) -> list[dict[str, Any]]:
    """pyorch / transformers output tokens/s: per batch size, or pyorch against HF's best."""
    ours = [r for r in rows if r["engine"] == "pyorch"]
    theirs = [r for r in rows if r["engine"] == "transformers"]
    if hf_best:
        pairs = [(ours[0], theirs[0])] if ours and theirs else []
    else:
        by_size = {r["batch_size"]: r for r in theirs}
        pairs = [(r, by_size[r["batch_size"]]) for r in ours if r["batch_size"] in by_size]
    return [{"pyorch_batch_size": a["batch_size"], "transformers_batch_size": b["batch_size"],
             "output_tokens_per_s_ratio": a["output_tokens_per_s"] / b["output_tokens_per_s"]}
            for a, b in pairs]


def plot(path: str, rows: list[dict[str, Any]], title: str) -> None:
    plt = common.pyplot()
    sizes = sorted({r["batch_size"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    for k, engine in enumerate(("pyorch", "transformers")):
        by_size = {r["batch_size"]: r["output_tokens_per_s"] for r in rows if r["engine"] == engine}
        xs = [i + (k - 0.5) * width for i, s in enumerate(sizes) if s in by_size]
        ax.bar(xs, [by_size[s] for s in sizes if s in by_size], width, label=engine)
    ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
    ax.set_xlabel("batch size (pyorch: max_num_seqs)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main(args: argparse.Namespace) -> int:
    from pyorch.model_loader import load_hf_config

    device = common.resolve_device(args.device)
    model = common.resolve_model(args.model)
    env = common.environment(device)
    seed = args.seed or 0
    vocab = int(load_hf_config(model).vocab_size)
    samples = datasets.sample_requests(args, args.num_prompts, args.input_len, args.output_len,
                                       args.random_range_ratio, vocab, seed)
    prompts = [s.prompt_token_ids for s in samples]
    output_lens = [s.output_len for s in samples]
    if not args.skip_hf and len(set(output_lens)) > 1:
        raise ValueError("this workload's output lengths vary, and the transformers baseline "
                         "generates one length per batch: pass --skip-hf")
    args.hf_output_len = output_lens[0]
    warm_lengths = common.random_lengths(args.input_len, 0.0, 2, seed + 1)
    warmup_prompts = common.random_token_prompts(warm_lengths, vocab, seed + 1)

    rows, info = measure(args, model, device, prompts, warmup_prompts, output_lens)
    ratios = compare(rows, args.hf_best)
    for r in ratios:
        print(f"pyorch (batch {r['pyorch_batch_size']}) / transformers (batch "
              f"{r['transformers_batch_size']}): {r['output_tokens_per_s_ratio']:.2f}x "
              "output tok/s")
    json_path, png_path = common.output_paths(NAME, device, args.output_json)
    doc = {"benchmark": NAME, "model": model, "args": common.args_dict(args), "env": env,
           "workload": datasets.describe(args, args.input_len, args.output_len,
                                         args.random_range_ratio),
           "rows": rows, "summary": {"ratios": ratios, **info}}
    common.write_json(json_path, doc)
    if not args.no_plot:
        workload = ", ".join(f"{k} {v}" for k, v in datasets.describe(
            args, args.input_len, args.output_len, args.random_range_ratio).items())
        plot(png_path, rows, f"{NAME}: {os.path.basename(model)}, {device}, {workload}, "
                             f"{len(prompts)} prompts")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cli_args(parser)
    raise SystemExit(main(parser.parse_args()))
