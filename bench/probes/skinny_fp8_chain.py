"""Which launch settings of the fp8-weight decode GEMMs (skinny_gemm_fp8) give the fastest batch-1
decode step inside the engine, where each GEMM follows the layer's other kernels (a sweep of one
kernel repeated, as bench_scaled_mm's, does not show how PDL or an L2 prefetch overlaps with the
kernel before).

    python bench/probes/skinny_fp8_chain.py --model MODEL [--configs "SPEC|SPEC|..."] [--json OUT]

One engine (Llama-3-8B shape, --quantization fp8 --kv-cache-dtype fp8); for each config (the
PYORCH_SKINNY_FP8_OVERRIDE syntax, pyorch._ops.parse_skinny_fp8_override; "" = the picks) the
override is set, the CUDA graphs are captured again, and decode ms/token is timed as the latency
benchmark does: (a request of --output-len tokens - a prefill-only request) / (--output-len - 1),
medians of --reps, each on a fresh prefix cache. Configs are timed in rounds, rotated each round,
so clock drift does not favour one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pyorch import LLM, SamplingParams
from pyorch import _ops

DEFAULT_CONFIGS = [
    "",
    "normed=-1,-1,-1,1;normed_silu=-1,-1,-1,1;add=-1,-1,-1,1",
    "normed=-1,0,-1,1;normed_silu=-1,0,-1,1;add=-1,0,-1,1",
    "normed=-1,-1,2,1;normed_silu=-1,-1,2,1;add=-1,-1,2,1",
    "normed=-1,-1,4,1;normed_silu=-1,-1,4,1;add=-1,-1,4,1",
    "normed=-1,-1,2,-1;normed_silu=-1,-1,2,-1;add=-1,-1,2,-1",
    "normed=-1,-1,4,-1;normed_silu=-1,-1,4,-1;add=-1,-1,4,-1",
    "normed=8,-1,-1,-1;normed_silu=8,-1,-1,-1",
    "add=4,-1,-1,-1",
    "normed=8,-1,-1,1;normed_silu=8,-1,-1,1;add=-1,-1,-1,1",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--configs", default=None, help="'|'-separated override specs")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=65)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    configs = args.configs.split("|") if args.configs is not None else DEFAULT_CONFIGS
    for spec in configs:
        _ops.parse_skinny_fp8_override(spec)  # malformed specs fail before the model loads

    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048,
              quantization="fp8", kv_cache_dtype="fp8", max_num_seqs=1)
    runner = llm.llm_engine.engine_core.model_executor.model_runner
    vocab = llm.llm_engine.config.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = {"prompt_token_ids": torch.randint(100, vocab - 100, (args.input_len,),
                                                generator=gen).tolist()}

    def request(max_tokens: int) -> float:
        llm.reset_prefix_cache()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {spec: [] for spec in configs}
    for rnd in range(args.rounds):
        order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
        for spec in order:
            _ops.set_skinny_fp8_override(spec)
            runner.capture_model()
            request(args.output_len)  # warm the new graphs
            full = statistics.median(request(args.output_len) for _ in range(args.reps))
            prefill = statistics.median(request(1) for _ in range(args.reps))
            times[spec].append((full - prefill) / (args.output_len - 1) * 1e3)
    _ops.set_skinny_fp8_override("")
    base = statistics.median(times[configs[0]])
    rows = []
    for spec in configs:
        ms = statistics.median(times[spec])
        rows.append({"override": spec or "(picks)", "decode_ms_per_token": ms,
                     "rounds_ms": times[spec], "vs_first": base / ms})
        print(f"{ms:7.3f} ms/token  x{base / ms:5.3f}  {spec or '(picks)'}  "
              f"[{', '.join(f'{t:.3f}' for t in times[spec])}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
