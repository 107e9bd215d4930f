"""Synthetic workloads that need no download, shared by `pyorch bench serve` and
`pyorch bench throughput`: each is a list of (prompt token ids, output length).

- `random` (vLLM's): prompt and output lengths uniform in [len * (1 - r), len * (1 + r)] with
  r = `--random-range-ratio`, applied to both; token ids uniform over the vocabulary.
- `prefix_repetition` (vLLM's): `--prefix-repetition-num-prefixes` random prefixes of
  `--prefix-repetition-prefix-len` tokens; each request is one of them (requests spread evenly
  over the prefixes, in shuffled order) followed by its own random suffix of
  `--prefix-repetition-suffix-len` tokens, and asks for `--prefix-repetition-output-len` tokens.
- `longtail` (pyorch's own): prompt and output lengths drawn from log-normal distributions whose
  medians are `--longtail-input-len` / `--longtail-output-len` and whose shape is
  `--longtail-sigma` (the standard deviation of the log length; 1.0 puts the 99th percentile at
  ~10x the median), capped at `--longtail-max-len` tokens (prompt + output) and never below 1:
  many short requests, a few very long ones, as real traffic has.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

DATASETS = ("random", "prefix_repetition", "longtail")


@dataclass
class SampledRequest:
    prompt_token_ids: list[int]
    output_len: int


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """The dataset flags other than the random dataset's lengths (each bench names those)."""
    parser.add_argument("--dataset-name", choices=DATASETS, default="random",
                        help="synthetic workload (pyorch.benchmarks.datasets; default random)")
    group = parser.add_argument_group("prefix_repetition dataset (vLLM's flags)")
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    group.add_argument("--prefix-repetition-output-len", type=int, default=128)
    group = parser.add_argument_group("longtail dataset (log-normal lengths)")
    group.add_argument("--longtail-input-len", type=int, default=256, help="median prompt length")
    group.add_argument("--longtail-output-len", type=int, default=128,
                       help="median output length")
    group.add_argument("--longtail-sigma", type=float, default=1.0,
                       help="standard deviation of the log lengths")
    group.add_argument("--longtail-max-len", type=int, default=8192,
                       help="cap on prompt + output tokens of one request")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def random_dataset(num: int, input_len: int, output_len: int, range_ratio: float,
                   vocab_size: int, seed: int) -> list[SampledRequest]:
    from pyorch.benchmarks.common import random_lengths, random_token_prompts

    in_lens = random_lengths(input_len, range_ratio, num, seed)
    out_lens = random_lengths(output_len, range_ratio, num, seed + 1)
    prompts = random_token_prompts(in_lens, vocab_size, seed + 2)
    return [SampledRequest(p, n) for p, n in zip(prompts, out_lens, strict=True)]


def prefix_repetition_dataset(num: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                              output_len: int, vocab_size: int,
                              seed: int) -> list[SampledRequest]:
    import numpy as np

    _positive("--prefix-repetition-num-prefixes", num_prefixes)
    _positive("--prefix-repetition-output-len", output_len)
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise ValueError("prefix and suffix lengths must be >= 0 and not both 0")
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab_size, size=prefix_len).tolist()
                for _ in range(num_prefixes)]
    owners = [i % num_prefixes for i in range(num)]
    rng.shuffle(owners)
    return [SampledRequest(prefixes[k] + rng.integers(0, vocab_size, size=suffix_len).tolist(),
                           output_len) for k in owners]


def longtail_lengths(num: int, median: int, sigma: float, cap: int, seed: int) -> list[int]:
    """`num` log-normal lengths with this median and log standard deviation, in [1, cap]."""
    import numpy as np

    _positive("median length", median)
    if not sigma >= 0:
        raise ValueError(f"--longtail-sigma must be >= 0, got {sigma}")
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(mean=math.log(median), sigma=sigma, size=num)
    return [int(min(max(1, round(x)), cap)) for x in draws]


def longtail_dataset(num: int, input_median: int, output_median: int, sigma: float,
                     max_len: int, vocab_size: int, seed: int) -> list[SampledRequest]:
    from pyorch.benchmarks.common import random_token_prompts

    if max_len < 2:
        raise ValueError(f"--longtail-max-len must be >= 2, got {max_len}")
    in_lens = longtail_lengths(num, input_median, sigma, max_len - 1, seed)
    out_lens = longtail_lengths(num, output_median, sigma, max_len - 1, seed + 1)
    # The cap is on the whole request: trim the output of the few that pass it.
    out_lens = [max(1, min(o, max_len - i)) for i, o in zip(in_lens, out_lens, strict=True)]
    prompts = random_token_prompts(in_lens, vocab_size, seed + 2)
    return [SampledRequest(p, n) for p, n in zip(prompts, out_lens, strict=True)]


def sample_requests(args: argparse.Namespace, num: int, input_len: int, output_len: int,
                    range_ratio: float, vocab_size: int, seed: int) -> list[SampledRequest]:
    """The `--dataset-name` workload; input_len / output_len / range_ratio are the random
    dataset's (each bench has its own flag names for them)."""
    name = args.dataset_name
    if name == "random":
        return random_dataset(num, input_len, output_len, range_ratio, vocab_size, seed)
    if name == "prefix_repetition":
        return prefix_repetition_dataset(
            num, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len,
            vocab_size, seed)
    if name == "longtail":
        return longtail_dataset(num, args.longtail_input_len, args.longtail_output_len,
                                args.longtail_sigma, args.longtail_max_len, vocab_size, seed)
    raise ValueError(f"unknown dataset {name!r} (expected one of {', '.join(DATASETS)})")


def describe(args: argparse.Namespace, input_len: int, output_len: int,
             range_ratio: float) -> dict[str, Any]:
    """The workload's parameters, for titles and JSON."""
    name = args.dataset_name
    if name == "prefix_repetition":
        return {"dataset": name, "prefix_len": args.prefix_repetition_prefix_len,
                "suffix_len": args.prefix_repetition_suffix_len,
                "num_prefixes": args.prefix_repetition_num_prefixes,
                "output_len": args.prefix_repetition_output_len}
    if name == "longtail":
        return {"dataset": name, "input_median": args.longtail_input_len,
                "output_median": args.longtail_output_len, "sigma": args.longtail_sigma,
                "max_len": args.longtail_max_len}
    return {"dataset": name, "input_len": input_len, "output_len": output_len,
            "range_ratio": range_ratio}
