"""The synthetic workloads of `pyorch bench serve` / `throughput` (pyorch.benchmarks.datasets)."""

from __future__ import annotations

import argparse
import statistics
from collections import Counter

import pytest

from pyorch.benchmarks import datasets


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    datasets.add_dataset_args(parser)
    return parser.parse_args(argv)


def test_random_range_ratio_applies_to_input_and_output():
    reqs = datasets.sample_requests(_args([]), 400, 100, 50, 0.9, 1000, seed=3)
    ins = [len(r.prompt_token_ids) for r in reqs]
    outs = [r.output_len for r in reqs]
    assert 9 <= min(ins) < 30 and 170 < max(ins) <= 191  # uniform in [100*0.1, 100*1.9]
    assert 4 <= min(outs) < 15 and 85 < max(outs) <= 96  # uniform in [50*0.1, 50*1.9]
    assert all(0 <= t < 1000 for r in reqs for t in r.prompt_token_ids)
    fixed = datasets.sample_requests(_args([]), 5, 7, 3, 0.0, 1000, seed=3)
    assert {len(r.prompt_token_ids) for r in fixed} == {7} and {r.output_len for r in fixed} == {3}
    again = datasets.sample_requests(_args([]), 400, 100, 50, 0.9, 1000, seed=3)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]


def test_prefix_repetition_shares_prefixes_evenly():
    args = _args(["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "32",
                  "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "3",
                  "--prefix-repetition-output-len", "5"])
    reqs = datasets.sample_requests(args, 12, 999, 999, 0.5, 5000, seed=0)
    assert all(len(r.prompt_token_ids) == 40 and r.output_len == 5 for r in reqs)
    prefixes = Counter(tuple(r.prompt_token_ids[:32]) for r in reqs)
    assert sorted(prefixes.values()) == [4, 4, 4]
    assert len({tuple(r.prompt_token_ids[32:]) for r in reqs}) == 12  # own suffixes
    owners = [tuple(r.prompt_token_ids[:32]) for r in reqs]
    assert owners != sorted(owners, key=list(prefixes).index)  # shuffled, not grouped
    with pytest.raises(ValueError, match="num-prefixes"):
        datasets.sample_requests(_args(["--dataset-name", "prefix_repetition",
                                        "--prefix-repetition-num-prefixes", "0"]),
                                 4, 1, 1, 0.0, 100, seed=0)


def test_longtail_is_log_normal_and_capped():
    args = _args(["--dataset-name", "longtail", "--longtail-input-len", "200",
                  "--longtail-output-len", "50", "--longtail-sigma", "1.0",
                  "--longtail-max-len", "2000"])
    reqs = datasets.sample_requests(args, 3000, 1, 1, 0.0, 1000, seed=1)
    ins = [len(r.prompt_token_ids) for r in reqs]
    outs = [r.output_len for r in reqs]
    assert statistics.median(ins) == pytest.approx(200, rel=0.1)
    assert statistics.median(outs) == pytest.approx(50, rel=0.1)
    assert max(ins) > 8 * 200 and min(ins) < 200 / 8  # a long tail on both sides
    assert all(i + o <= 2000 and i >= 1 and o >= 1 for i, o in zip(ins, outs, strict=True))
    desc = datasets.describe(args, 1, 1, 0.0)
    assert desc == {"dataset": "longtail", "input_median": 200, "output_median": 50,
                    "sigma": 1.0, "max_len": 2000}
