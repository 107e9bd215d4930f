"""CPU decode speed of the default model (SmolLM2-135M-Instruct Q4_1 GGUF) from its GGUF blocks:
pyorch against llama.cpp (llama-cpp-python, the same file, the same thread count) and against
transformers (float32, the same weights dequantized), in one run.

For each engine and batch size (1 and 16 sequences decoding together) it times greedy generation
of `--output-len` tokens after a `--input-len`-token random prompt, and the same with one output
token; the difference is the decode time, so prefill and start-up are not counted:
ms/token = (t(output_len) - t(1)) / (output_len - 1) per decode step, tokens/s = batch / that.
Engines and batch sizes are interleaved repeat by repeat (the machine is shared: load falls on
all alike) and the median of `--repeats` is reported. Prints the ratios pyorch / llama.cpp and
pyorch / transformers; writes JSON and a bar plot (default bench/results/cpu/gguf_cpu.{json,png}).

    python bench/gguf_cpu.py [--threads 2] [--repeats 3] [--input-len 32] [--output-len 64]

llama-cpp-python is a benchmark-only baseline (not in requirements-ci.txt); without it the run
says so and goes on without that column.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import numpy as np
import torch

from pyorch.benchmarks.common import environment, pyplot, write_json

BATCHES = [1, 16]


def _prompts(batch: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # skip the first ids (special tokens) so every prompt is plain text tokens
    return [rng.integers(100, vocab, size=input_len).tolist() for _ in range(batch)]


class PyorchRunner:
    name = "pyorch"

    def __init__(self, model: str, threads: int, max_len: int) -> None:
        from pyorch import LLM

        torch.set_num_threads(threads)
        self.llms = {
            b: LLM(model=model, device="cpu", max_num_seqs=b, max_model_len=max_len, seed=0,
                   enable_prefix_caching=False)
            for b in BATCHES
        }

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        from pyorch import SamplingParams

        params = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0,
                                ignore_eos=True)
        outs = self.llms[len(prompts)].generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]


class TransformersRunner:
    name = "transformers"

    def __init__(self, model: str, threads: int, max_len: int) -> None:
        from pyorch.benchmarks.hf_baseline import load_hf_model

        torch.set_num_threads(threads)
        self.model, self.how = load_hf_model(model, "gguf", torch.float32, "cpu")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        ids = torch.tensor(prompts, dtype=torch.long)  # equal lengths: no padding
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=output_len, min_new_tokens=output_len,
                                  do_sample=False, num_beams=1,
                                  pad_token_id=self.model.config.eos_token_id)
        return out[:, ids.shape[1]:].tolist()


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's low-level API: one context with a sequence per
    prompt, prefill of every prompt, then one llama_decode per step with one token per sequence
    (greedy: the argmax of each sequence's logits)."""

    name = "llama.cpp"

    def __init__(self, model: str, threads: int, max_len: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        # The Llama object loads the model; the context (one sequence per prompt) is our own.
        self.llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_ctx=max_len,
                                   verbose=False)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max(BATCHES) * max_len
        params.n_batch = max(BATCHES) * max_len
        params.n_ubatch = 512
        params.n_seq_max = max(BATCHES)
        params.n_threads = threads
        params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.llm._model.model, params)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.vocab = self.llm.n_vocab()
        self.version = getattr(llama_cpp, "__version__", "?")

    def _clear(self) -> None:
        lib = self.lib
        if hasattr(lib, "llama_memory_clear"):
            lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        else:
            lib.llama_kv_self_clear(self.ctx)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, want logits)."""
        lib = self.lib
        batch = lib.llama_batch_init(len(entries), 0, 1)
        try:
            batch.n_tokens = len(entries)
            for i, (tok, pos, seq, logits) in enumerate(entries):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = logits
            rc = lib.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        finally:
            lib.llama_batch_free(batch)

    def _argmax(self, i: int) -> int:
        ptr = self.lib.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).argmax())

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        self._clear()
        entries = [
            (tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts)
            for pos, tok in enumerate(p)
        ]
        self._decode(entries)
        last = [i for i, e in enumerate(entries) if e[3]]
        out = [[self._argmax(i)] for i in last]
        for step in range(1, output_len):
            self._decode([
                (out[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(prompts)
            ])
            for s in range(len(prompts)):
                out[s].append(self._argmax(s))
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--engines", default="pyorch,llama.cpp,transformers")
    parser.add_argument("--output-json", default="bench/results/cpu/gguf_cpu.json")
    args = parser.parse_args()

    from pyorch.model_loader import default_model_path, load_hf_config

    model = args.model or default_model_path()
    vocab = load_hf_config(model).vocab_size
    max_len = args.input_len + args.output_len + 8
    torch.set_num_threads(args.threads)
    wanted = args.engines.split(",")
    runners: list[Any] = []
    skipped: dict[str, str] = {}
    for cls in (PyorchRunner, LlamaCppRunner, TransformersRunner):
        if cls.name not in wanted:
            continue
        try:
            runners.append(cls(model, args.threads, max_len))
        except ImportError as e:
            skipped[cls.name] = f"not installed ({e})"
            print(f"{cls.name}: skipped, not installed: {e}")
    prompts = {b: _prompts(b, args.input_len, vocab, seed=b) for b in BATCHES}
    for r in runners:  # warm-up (and the first call's one-time costs)
        for b in BATCHES:
            r.generate(prompts[b], 4)

    times: dict[tuple[str, int], list[float]] = {}
    first_tokens: dict[tuple[str, int], list[int]] = {}
    for rep in range(args.repeats):
        for b in BATCHES:
            for r in runners:
                start = time.perf_counter()
                r.generate(prompts[b], 1)
                t1 = time.perf_counter() - start
                start = time.perf_counter()
                out = r.generate(prompts[b], args.output_len)
                tn = time.perf_counter() - start
                times.setdefault((r.name, b), []).append((tn - t1) / (args.output_len - 1))
                first_tokens[(r.name, b)] = out[0][:16]
                print(f"repeat {rep} {r.name:12s} batch {b:2d}: "
                      f"{times[(r.name, b)][-1] * 1e3:7.2f} ms/step", flush=True)
                # written after every measurement: a run cut short keeps what it measured
                report(args, model, times, first_tokens, skipped, final=False)
    report(args, model, times, first_tokens, skipped, final=True)
    print(f"wrote {args.output_json}")
    return 0


def report(args: argparse.Namespace, model: str, times: dict[tuple[str, int], list[float]],
           first_tokens: dict[tuple[str, int], list[int]], skipped: dict[str, str],
           final: bool) -> None:
    """Prints the table and ratios so far and writes the JSON ("complete": final) and plot."""
    rows = []
    for (name, b), ts in times.items():
        step = statistics.median(ts)
        rows.append({"engine": name, "batch": b, "ms_per_step": step * 1e3,
                     "ms_per_token": step * 1e3 / b, "tokens_per_s": b / step,
                     "runs_ms_per_step": [t * 1e3 for t in ts]})
    by = {(r["engine"], r["batch"]): r for r in rows}
    ratios = {}
    for b in BATCHES:
        mine = by.get(("pyorch", b))
        for other in ("llama.cpp", "transformers"):
            theirs = by.get((other, b))
            if mine and theirs:
                ratios[f"pyorch/{other} batch {b}"] = mine["tokens_per_s"] / theirs["tokens_per_s"]
    print()
    print(f"{'engine':14s} {'batch':>5s} {'ms/step':>9s} {'ms/token':>9s} {'tokens/s':>9s}")
    for r in sorted(rows, key=lambda r: (r["batch"], r["engine"])):
        print(f"{r['engine']:14s} {r['batch']:5d} {r['ms_per_step']:9.2f} "
              f"{r['ms_per_token']:9.2f} {r['tokens_per_s']:9.1f}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    for name, why in skipped.items():
        print(f"{name}: {why}")
    same = {
        b: first_tokens.get(("pyorch", b)) == first_tokens.get(("llama.cpp", b))
        for b in BATCHES if ("llama.cpp", b) in first_tokens
    }
    doc = {
        "env": environment("cpu"),
        "args": vars(args),
        "model": os.path.basename(model),
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "load_average_end": os.getloadavg(),
        "rows": rows,
        "ratios": ratios,
        "skipped": skipped,
        "first_16_tokens_of_sequence_0": {f"{k[0]} batch {k[1]}": v
                                           for k, v in first_tokens.items()},
        "pyorch_equals_llama_cpp_first_tokens": same,
    }
    doc["complete"] = final
    write_json(args.output_json, doc)
    plot(os.path.splitext(args.output_json)[0] + ".png", rows, ratios)


def plot(path: str, rows: list[dict[str, Any]], ratios: dict[str, float]) -> None:
    plt = pyplot()
    engines = [e for e in ("pyorch", "llama.cpp", "transformers")
               if any(r["engine"] == e for r in rows)]
    fig, axes = plt.subplots(1, len(BATCHES), figsize=(10, 4))
    for ax, b in zip(axes, BATCHES, strict=True):
        vals = [next((r["tokens_per_s"] for r in rows if r["engine"] == e and r["batch"] == b),
                     0.0) for e in engines]
        bars = ax.bar(engines, vals, color=["#1f77b4", "#ff7f0e", "#2ca02c"][: len(engines)])
        ax.bar_label(bars, fmt="%.1f")
        mine = [f"{k.split(' batch')[0]} {v:.2f}x" for k, v in ratios.items()
                if k.endswith(f"batch {b}")]
        ax.set_title(f"batch {b}: decode tokens/s (higher is better)\n" + ", ".join(mine))
        ax.set_ylabel("tokens/s")
    fig.suptitle("SmolLM2-135M-Instruct Q4_1 GGUF, 2 CPU threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
