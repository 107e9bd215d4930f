"""The sampler's draw at temperature 1 (vLLM's benchmark sampling): the one-pass kernel
(`random_sample_from_logits`, `PYORCH_FUSED_SAMPLER=1`) against the unfused exponential race
(`=0`: a float32 copy, the division, a noise tensor, its log, the subtraction, the argmax), on
[rows, vocab] logits of the model's dtype, through `Sampler` as the runner calls it.

Baseline of the same run: one read of the logits at the device's copy bandwidth (a clone of the
logits, timed alike, counted as read + write), the floor of any draw that reads them. Rows give
the median time of `--iters` calls (synchronized on CUDA), each form's ratio to the floor, and
the speed-up of the kernel over the unfused draw; the two forms alternate call by call.

    python bench/sampler.py --device cuda --rows 1,64,256,1024 --vocab 128256
    python bench/sampler.py --device cpu --rows 1,16,64 --iters 5

Writes bench/results/<device name>/sampler.json (or --output-json).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from pyorch.benchmarks import common
from pyorch.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from pyorch.sampling_params import SamplingParams

NAME = "sampler"


def _time_ms(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--rows", default="1,64,256,1024")
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    device = common.resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    sampler = Sampler()
    results = []
    for rows in common.parse_int_list(args.rows):
        logits = torch.randn(rows, args.vocab, device=device).to(dtype)
        params = SamplingParams(temperature=args.temperature)
        batch = [SamplingRow(params, [], [], None) for _ in range(rows)]
        forms = {}
        for flag in ("1", "0"):
            os.environ["PYORCH_FUSED_SAMPLER"] = flag
            metadata = SamplingMetadata.from_requests(batch, args.vocab, device)
            forms[flag] = (lambda m=metadata, x=logits: sampler(x, m))
        copy = lambda x=logits: x.clone()  # noqa: E731
        times: dict[str, list[float]] = {"fused": [], "unfused": [], "copy": []}
        for fn in (forms["1"], forms["0"], copy):  # warm-up
            fn()
        for _ in range(args.iters):
            times["fused"].append(_time_ms(forms["1"], device))
            times["unfused"].append(_time_ms(forms["0"], device))
            times["copy"].append(_time_ms(copy, device))
        med = {k: common.median(v) for k, v in times.items()}
        read_ms = med["copy"] / 2  # a clone reads and writes the logits once each
        row = dict(rows=rows, vocab=args.vocab, dtype=args.dtype, fused_ms=med["fused"],
                   unfused_ms=med["unfused"], logits_read_floor_ms=read_ms,
                   speedup=med["unfused"] / med["fused"],
                   fused_x_floor=med["fused"] / read_ms, unfused_x_floor=med["unfused"] / read_ms)
        results.append(row)
        print(f"rows {rows:5d} x {args.vocab}: fused {med['fused']:8.3f} ms, unfused "
              f"{med['unfused']:8.3f} ms ({row['speedup']:.2f}x), floor (one read) "
              f"{read_ms:7.3f} ms: fused {row['fused_x_floor']:.1f}x the floor, unfused "
              f"{row['unfused_x_floor']:.1f}x")
    os.environ.pop("PYORCH_FUSED_SAMPLER", None)
    path, _ = common.output_paths(NAME, device, args.output_json)
    common.write_json(path, dict(benchmark=NAME, args=common.args_dict(args),
                                 environment=common.environment(device), results=results))


if __name__ == "__main__":
    main()
