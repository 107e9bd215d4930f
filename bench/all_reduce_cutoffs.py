"""The custom all-reduce's size table from a bench_custom_all_reduce run: for each message size
the fastest of the kernel's algorithms, and NCCL from the first size where NCCL is as fast.
Prints `ALGO_LIMITS[ranks]` for pyorch/distributed/custom_all_reduce.py.

    python bench/all_reduce_cutoffs.py RESULT.json [--mode graph] [--margin 1.0]

Only rows of one timing mode count (graph replays by default: the engine's decode runs the
all-reduce inside CUDA graphs). A size is given to the kernel while its best algorithm is at least
--margin times faster than NCCL; the table stops at the first size where it is not (a larger
message is never faster on the kernel's side once NCCL's bandwidth wins).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# pyorch/distributed/custom_all_reduce.py's constants, by the benchmark's algorithm names.
ALGOS = {"one_shot": "ALGO_ONE_SHOT", "two_shot": "ALGO_TWO_SHOT",
         "one_shot_push": "ALGO_ONE_SHOT_PUSH"}


def algo_limits(rows: list[dict[str, Any]], mode: str = "graph",
                margin: float = 1.0) -> dict[int, list[tuple[int, str]]]:
    """{ranks: [(up to bytes, algo name), ...]} with consecutive sizes of one algorithm merged;
    an empty list where NCCL wins at the smallest size. Rows with wrong results are refused."""
    times: dict[int, dict[int, dict[str, float]]] = {}
    for row in rows:
        if row.get("op") != "all_reduce" or row.get("mode", "eager") != mode:
            continue
        if int(row.get("wrong", 0)):
            raise ValueError(f"wrong results in {row}: no table from a run that failed its check")
        name = "nccl" if row["impl"] == "nccl" else str(row["algo"])
        if name != "nccl" and name not in ALGOS:
            continue  # "auto" is one of the others
        times.setdefault(int(row["ranks"]), {}).setdefault(int(row["bytes"]), {})[name] = float(
            row["time_us"])
    table: dict[int, list[tuple[int, str]]] = {}
    for ranks, by_size in sorted(times.items()):
        limits: list[tuple[int, str]] = []
        for size in sorted(by_size):
            t = by_size[size]
            custom = {a: us for a, us in t.items() if a != "nccl"}
            if "nccl" not in t or not custom:
                continue
            best = min(custom, key=lambda a: custom[a])
            if t["nccl"] < margin * custom[best]:
                break
            if limits and limits[-1][1] == best:
                limits[-1] = (size, best)
            else:
                limits.append((size, best))
        table[ranks] = limits
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result", help="bench_custom_all_reduce --json output")
    parser.add_argument("--mode", default="graph", choices=("graph", "eager"))
    parser.add_argument("--margin", type=float, default=1.0)
    args = parser.parse_args()
    with open(args.result) as f:
        rows = json.load(f)
    table = algo_limits(rows, args.mode, args.margin)
    if not table:
        print(f"no {args.mode} all-reduce rows with NCCL in {args.result}", file=sys.stderr)
        return 1
    for ranks, limits in table.items():
        body = ", ".join(f"({size >> 10} << 10, {ALGOS[a]})" for size, a in limits)
        print(f"    {ranks}: [{body}],")
    return 0


if __name__ == "__main__":
    sys.exit(main())
