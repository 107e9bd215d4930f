"""pyorch.benchmarks.common: percentiles, workloads, engine flags, result paths."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from pyorch.benchmarks import common


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    data = [7.0, 1.0, 3.0, 10.0, 2.5, 8.0, 4.0]
    assert common.percentile(data, q) == pytest.approx(float(np.percentile(data, q)))


def test_percentile_known_values():
    data = list(range(1, 101))  # 1..100
    assert common.percentile(data, 50) == pytest.approx(50.5)
    assert common.percentile(data, 90) == pytest.approx(90.1)
    assert common.percentile(data, 99) == pytest.approx(99.01)
    assert common.percentile([5.0], 99) == 5.0
    assert np.isnan(common.percentile([], 50))
    with pytest.raises(ValueError):
        common.percentile(data, 101)


def test_random_lengths_range_and_determinism():
    fixed = common.random_lengths(32, 0.0, 5, seed=0)
    assert fixed == [32] * 5
    spread = common.random_lengths(100, 0.5, 200, seed=3)
    assert min(spread) >= 50 and max(spread) <= 150 and len(set(spread)) > 10
    assert spread == common.random_lengths(100, 0.5, 200, seed=3)
    with pytest.raises(ValueError):
        common.random_lengths(10, 1.0, 3, seed=0)


def test_random_token_prompts():
    prompts = common.random_token_prompts([3, 7, 1], vocab_size=50, seed=1, low_id=5)
    assert [len(p) for p in prompts] == [3, 7, 1]
    assert all(5 <= t < 50 for p in prompts for t in p)
    assert prompts == common.random_token_prompts([3, 7, 1], vocab_size=50, seed=1, low_id=5)
    assert prompts != common.random_token_prompts([3, 7, 1], vocab_size=50, seed=2, low_id=5)


def test_engine_flags_follow_engine_args():
    parser = argparse.ArgumentParser()
    common.add_engine_args(parser)
    args = parser.parse_args([])
    assert common.engine_kwargs(args) == {}  # nothing given: the engine keeps its defaults
    args = parser.parse_args(["--model", "m", "--max-num-seqs", "4", "--dtype", "bfloat16",
                              "--no-enable-prefix-caching", "--load-format", "dummy",
                              "--gpu-memory-utilization", "0.5", "--cuda-graph-sizes", "1", "2"])
    kwargs = common.engine_kwargs(args, device="cpu")
    assert kwargs == {"max_num_seqs": 4, "dtype": "bfloat16", "enable_prefix_caching": False,
                      "load_format": "dummy", "gpu_memory_utilization": 0.5,
                      "cuda_graph_sizes": [1, 2], "device": "cpu"}
    assert args.model == "m"


def test_parse_int_list_and_paths():
    assert common.parse_int_list("1,16, 64") == [1, 16, 64]
    with pytest.raises(argparse.ArgumentTypeError):
        common.parse_int_list("0,2")
    assert common.results_dir("cpu").replace("\\", "/") == "bench/results/cpu"
    assert common.output_paths("latency", "cpu", None) == (
        "bench/results/cpu/latency.json", "bench/results/cpu/latency.png")
    assert common.output_paths("x", "cpu", "/tmp/a/b.json") == ("/tmp/a/b.json", "/tmp/a/b.png")
