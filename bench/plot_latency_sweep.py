"""JSON and a plot from `bench/latency_sweep.sh` logs (or any `pyorch bench latency` logs).

    python bench/plot_latency_sweep.py --out PREFIX --title "..." NAME=LOG [NAME=LOG ...]

Reads each log's decode ms/token, and the weight-read floor and the cuBLAS GEMM chain that
`pyorch bench latency` measures in the same run, and writes PREFIX.json (one row per log) and
PREFIX.png (ms/token per variant, the floor and the cuBLAS chain of the first log that has them
as lines, and --target if given). Several logs under one NAME are plotted as one bar at their
mean, with each run as a dot.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any, Optional

_DECODE = re.compile(r"([0-9.]+) ms per output token, decode ([0-9.]+) ms/token")
_FLOOR = re.compile(r"weight-read floor: .* = ([0-9.]+) ms")
_CHAIN = re.compile(r"GEMM chain .* CUDA graph ([0-9.]+) ms")


def _first(pattern: re.Pattern[str], text: str, group: int = 1) -> Optional[float]:
    match = pattern.search(text)
    return float(match.group(group)) if match else None


def parse_log(path: str) -> dict[str, Any]:
    with open(path) as f:
        text = f.read()
    decode = _first(_DECODE, text, 2)
    if decode is None:
        raise SystemExit(f"{path}: no 'decode ... ms/token' line (did the run fail?)")
    return {"log": path, "ms_per_output_token": _first(_DECODE, text, 1),
            "decode_ms_per_token": decode, "weight_floor_ms": _first(_FLOOR, text),
            "cublas_chain_graph_ms": _first(_CHAIN, text)}


def plot(path: str, rows: list[dict[str, Any]], title: str,
         target: Optional[float] = None) -> None:
    from pyorch.benchmarks.common import pyplot

    plt = pyplot()
    names = list(dict.fromkeys(r["name"] for r in rows))
    runs = {n: [r["decode_ms_per_token"] for r in rows if r["name"] == n] for n in names}
    means = [sum(runs[n]) / len(runs[n]) for n in names]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(names) + 2.2))
    ax.barh(names, means, color="tab:blue", alpha=0.7)
    for i, n in enumerate(names):
        ax.plot(runs[n], [i] * len(runs[n]), "k.", ms=4)
        ax.text(means[i], i, f" {means[i]:.2f}", va="center")
    floor = next((r["weight_floor_ms"] for r in rows if r["weight_floor_ms"]), None)
    chain = next((r["cublas_chain_graph_ms"] for r in rows if r["cublas_chain_graph_ms"]), None)
    if floor:
        ax.axvline(floor, color="tab:green", ls="--", label=f"weight-read floor {floor:.2f}")
    if chain:
        ax.axvline(chain, color="tab:red", ls=":", label=f"cuBLAS GEMM chain (graph) {chain:.2f}")
    if target:
        ax.axvline(target, color="black", lw=0.8, label=f"target {target:.2f}")
    ax.set_xlabel("batch-1 decode, ms per token (lower is better)")
    ax.set_xlim(left=0.8 * min([*means, floor or means[0]]))
    ax.set_title(title, fontsize=9)
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", help="NAME=LOG")
    parser.add_argument("--out", required=True, help="output prefix (PREFIX.json, PREFIX.png)")
    parser.add_argument("--title", default="pyorch bench latency, Llama-3-8B shapes, dummy bf16")
    parser.add_argument("--target", type=float, default=None, help="a target ms/token to draw")
    args = parser.parse_args()
    rows = []
    for spec in args.logs:
        name, sep, path = spec.rpartition("=")  # names may hold "=", paths do not
        if not sep:
            raise SystemExit(f"expected NAME=LOG, got {spec!r}")
        rows.append({"name": name, **parse_log(path)})
    with open(args.out + ".json", "w") as f:
        json.dump({"title": args.title, "rows": rows}, f, indent=1)
    plot(args.out + ".png", rows, args.title, args.target)
    print(f"wrote {args.out}.json, {args.out}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
