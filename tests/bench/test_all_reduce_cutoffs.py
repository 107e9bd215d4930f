"""bench/all_reduce_cutoffs.py: the custom all-reduce's size table read off benchmark rows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.all_reduce_cutoffs import algo_limits


def _row(ranks: int, size: int, algo: str, us: float, mode: str = "graph", wrong: int = 0):
    impl = "nccl" if algo == "nccl" else "custom"
    return {"op": "all_reduce", "impl": impl, "algo": algo, "ranks": ranks, "bytes": size,
            "time_us": us, "mode": mode, "wrong": wrong}


def _rows() -> list[dict]:
    kib = 1 << 10
    rows = []
    # 2 ranks: push best to 64 KiB, pull one-shot at 128 KiB, NCCL from 256 KiB on (even though
    # one-shot wins again at 512 KiB: the table stops at the first loss).
    for size, push, pull, two, nccl in ((16 * kib, 4, 6, 9, 8), (32 * kib, 4.5, 6, 9, 8),
                                        (64 * kib, 5, 6, 9, 8), (128 * kib, 8, 7, 9, 9),
                                        (256 * kib, 10, 11, 12, 9.5), (512 * kib, 9, 9, 12, 10)):
        rows += [_row(2, size, "one_shot_push", push), _row(2, size, "one_shot", pull),
                 _row(2, size, "two_shot", two), _row(2, size, "nccl", nccl),
                 _row(2, size, "auto", 1.0), _row(2, size, "nccl", 0.1, mode="eager")]
    # 4 ranks: NCCL already wins at the smallest size.
    rows += [_row(4, 16 * kib, "one_shot_push", 20), _row(4, 16 * kib, "nccl", 10)]
    return rows


def test_fastest_algorithm_per_size_until_nccl_wins():
    table = algo_limits(_rows())
    kib = 1 << 10
    assert table == {2: [(64 * kib, "one_shot_push"), (128 * kib, "one_shot")], 4: []}


def test_margin_and_mode_and_wrong_rows():
    kib = 1 << 10
    # Asking for 1.5x: push is 2x NCCL at 16 KiB, 1.78x at 32 KiB, 1.6x at 64 KiB, pull 1.29x
    # at 128 KiB: the table stops there.
    assert algo_limits(_rows(), margin=1.5)[2] == [(64 * kib, "one_shot_push")]
    # Eager rows: only NCCL has them here, so no size has both.
    assert algo_limits(_rows(), mode="eager") == {2: []}
    with pytest.raises(ValueError, match="wrong results"):
        algo_limits([_row(2, 4096, "one_shot", 1.0, wrong=3)])


def test_cli_prints_the_table(tmp_path):
    path = tmp_path / "all_reduce.json"
    path.write_text(json.dumps(_rows()))
    out = subprocess.run([sys.executable, "bench/all_reduce_cutoffs.py", str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert "2: [(64 << 10, ALGO_ONE_SHOT_PUSH), (128 << 10, ALGO_ONE_SHOT)]," in out
    assert "4: []," in out
