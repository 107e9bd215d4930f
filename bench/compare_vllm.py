"""pyorch beside vLLM on the same GPU machine: one table, one JSON, one plot.

    python bench/compare_vllm.py --pyorch DIR [DIR ...] --vllm DIR --out PREFIX

Reads the JSON files `bench/gpu_check.sh --engine-bench` writes (latency.json,
throughput_<in>_<out>[_t0|_t1].json, startup.json) and those `bench/vllm_peer.sh` writes
(vllm_latency.json, vllm_throughput_<in>_<out>.json, vllm_startup.json); a workload missing on
either side is left out. Writes PREFIX.json and PREFIX.png (pyorch / vLLM per workload, higher is
better for pyorch).

vLLM's throughput bench samples at temperature 1.0: pyorch's temperature-1 run (`_t1`) is its
like-for-like row where it exists, the greedy run otherwise (said in the row).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Optional


def _load(dirs: list[str], name: str) -> Optional[dict[str, Any]]:
    for d in dirs:
        path = os.path.join(d, name)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
    return None


def _pyorch_tok_s(doc: dict[str, Any]) -> float:
    (row,) = [r for r in doc["rows"] if r["engine"] == "pyorch"]
    return row["output_tokens_per_s"]


def rows(pyorch_dirs: list[str], vllm_dir: str) -> list[dict[str, Any]]:
    out = []
    for inp, outp in ((128, 128), (1000, 1000), (2048, 128)):
        theirs = _load([vllm_dir], f"vllm_throughput_{inp}_{outp}.json")
        ours, sampling = None, None
        for suffix, what in (("_t1", "temperature 1.0"), ("", "greedy"), ("_t0", "greedy")):
            ours = _load(pyorch_dirs, f"throughput_{inp}_{outp}{suffix}.json")
            if ours is not None:
                sampling = what
                break
        if ours is None or theirs is None:
            continue
        v = theirs["tokens_per_second"] * outp / (inp + outp)  # vLLM reports total tokens/s
        p = _pyorch_tok_s(ours)
        out.append({"workload": f"throughput {inp}/{outp} x 1000", "unit": "output tok/s",
                    "pyorch": p, "vllm": v, "pyorch_over_vllm": p / v,
                    "pyorch_sampling": sampling, "vllm_sampling": "temperature 1.0"})
    ours, theirs = _load(pyorch_dirs, "latency.json"), _load([vllm_dir], "vllm_latency.json")
    if ours and theirs:
        out_len = ours["args"]["output_len"]
        p = ours["summary"]["request_latency_s_median"]
        v = theirs["percentiles"]["50"]
        out.append({"workload": f"latency batch 1, 128 in / {out_len} out", "unit": "s per request",
                    "pyorch": p, "vllm": v, "pyorch_over_vllm": v / p,
                    "pyorch_ms_per_token": 1e3 * p / out_len,
                    "vllm_ms_per_token": 1e3 * v / out_len})
    ours, theirs = _load(pyorch_dirs, "startup.json"), _load([vllm_dir], "vllm_startup.json")
    if ours and theirs:
        p = ours["summary"]["pyorch_median"]["total_s"]
        v = theirs["total_s"]
        out.append({"workload": "cold start to ready", "unit": "s", "pyorch": p, "vllm": v,
                    "pyorch_over_vllm": v / p})
    return out


def plot(path: str, table: list[dict[str, Any]], title: str,
         xlabel: str = "pyorch speed / vLLM 0.26 speed (same machine, same run)") -> None:
    from pyorch.benchmarks.common import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [r["workload"] for r in table]
    speedups = [r["pyorch_over_vllm"] for r in table]
    bars = ax.barh(names, speedups, color=["tab:green" if s >= 1 else "tab:red" for s in speedups])
    ax.axvline(1.0, color="black", lw=0.8)
    for bar, s in zip(bars, speedups):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {s:.2f}x", va="center")
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pyorch", nargs="+", required=True)
    parser.add_argument("--vllm", required=True)
    parser.add_argument("--out", required=True, help="output prefix (PREFIX.json, PREFIX.png)")
    parser.add_argument("--title", default="Llama-3-8B shapes, dummy bf16 weights")
    parser.add_argument("--note", default="")
    parser.add_argument("--xlabel",
                        default="pyorch speed / vLLM 0.26 speed (same machine, same run)",
                        help="the x axis' label: say so when the rows come from several runs")
    args = parser.parse_args()
    table = rows(args.pyorch, args.vllm)
    if not table:
        raise SystemExit("no workload found on both sides")
    for r in table:
        print(f"{r['workload']:>36}: pyorch {r['pyorch']:10.2f}  vLLM {r['vllm']:10.2f} "
              f"{r['unit']:<14} pyorch/vLLM speed {r['pyorch_over_vllm']:.3f}x")
    with open(args.out + ".json", "w") as f:
        json.dump({"rows": table, "note": args.note}, f, indent=1)
    plot(args.out + ".png", table, args.title, args.xlabel)
    print(f"wrote {args.out}.json, {args.out}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
