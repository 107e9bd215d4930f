"""Latency against throughput for two (or more) serving engines, from their result JSON files.

Each `--engine NAME FILE...` names one engine and its results: vLLM's `bench serve
--save-result` files (one per request rate; keys such as `output_throughput`, `median_ttft_ms`,
`p99_ttft_ms`, `p50_itl_ms`), or a `pyorch bench serve` JSON (a "runs" list, one per rate). The
plot has one panel per metric (TTFT, TPOT, ITL, E2E latency), output tokens/s on x, p50 solid and
p99 dashed, one colour per engine; a JSON beside it lists every point and, per request rate, each
engine's figures over the first engine's.

    python bench/plot_serve_compare.py --engine pyorch R/pyorch_*.json \\
        --engine vllm R/vllm_*.json --title "random 512/256 x500" --out R/latency.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")
_PYORCH_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2el": "e2e_ms"}


def _rate(value: Any) -> float:
    return math.inf if value in ("inf", None) else float(value)


def _from_vllm(doc: dict[str, Any]) -> dict[str, Any]:
    point: dict[str, Any] = {"request_rate": _rate(doc.get("request_rate")),
                             "output_throughput": float(doc["output_throughput"]),
                             "request_goodput": doc.get("request_goodput")}
    for m in METRICS:
        p50 = doc.get(f"p50_{m}_ms", doc.get(f"median_{m}_ms"))
        point[m] = {"p50": p50, "p99": doc.get(f"p99_{m}_ms")}
    return point


def _from_pyorch(run: dict[str, Any]) -> dict[str, Any]:
    point: dict[str, Any] = {"request_rate": _rate(run["request_rate"]),
                             "output_throughput": float(run["output_throughput"]),
                             "request_goodput": run.get("request_goodput")}
    for m, key in _PYORCH_KEYS.items():
        point[m] = {"p50": run[key]["p50"], "p99": run[key]["p99"]}
    return point


def load_points(paths: list[str]) -> list[dict[str, Any]]:
    """One point per request rate, sorted by rate, from result files of either format."""
    points = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        if "runs" in doc:
            points += [_from_pyorch(run) for run in doc["runs"]]
        elif "output_throughput" in doc:
            points.append(_from_vllm(doc))
        else:
            raise ValueError(f"{path}: neither a vLLM bench serve result nor a pyorch bench "
                             "serve JSON (no output_throughput, no runs)")
    return sorted(points, key=lambda p: p["request_rate"])


def compare(engines: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per request rate that every engine ran: each engine's figures over the first engine's
    (throughput: higher is better; latencies: lower is better)."""
    names = list(engines)
    base_name = names[0]
    by_rate = {name: {p["request_rate"]: p for p in pts} for name, pts in engines.items()}
    rows = []
    for rate in sorted(by_rate[base_name]):
        if not all(rate in by_rate[n] for n in names[1:]):
            continue
        base = by_rate[base_name][rate]
        for name in names[1:]:
            other = by_rate[name][rate]
            row: dict[str, Any] = {
                "request_rate": "inf" if math.isinf(rate) else rate,
                "engine": name, "baseline": base_name,
                "output_throughput_ratio": other["output_throughput"] / base["output_throughput"]}
            for m in METRICS:
                for q in ("p50", "p99"):
                    a, b = base[m][q], other[m][q]
                    row[f"{m}_{q}_ratio"] = b / a if a and b is not None else None
            rows.append(row)
    return rows


def plot(engines: dict[str, list[dict[str, Any]]], title: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, m in zip(axes, METRICS, strict=True):
        for color, (name, pts) in zip(colors, engines.items(), strict=False):
            x = [p["output_throughput"] for p in pts]
            for q, style in (("p50", "o-"), ("p99", "s--")):
                y = [p[m][q] for p in pts]
                if any(v is None for v in y):
                    continue  # that run did not report this percentile
                ax.plot(x, y, style, color=color, label=f"{name} {q}")
            for p in pts:
                if p[m]["p50"] is not None:
                    rate = "inf" if math.isinf(p["request_rate"]) else f"{p['request_rate']:g}"
                    ax.annotate(rate, (p["output_throughput"], p[m]["p50"]), fontsize=7,
                                textcoords="offset points", xytext=(3, 3))
        ax.set_title(m.upper())
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title + " (labels: request rate)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", nargs="+", action="append", required=True,
                        metavar=("NAME", "FILE"), help="an engine's name, then its result files")
    parser.add_argument("--title", default="latency against throughput")
    parser.add_argument("--out", required=True, help="PNG path (the JSON goes beside it)")
    args = parser.parse_args(argv)
    engines: dict[str, list[dict[str, Any]]] = {}
    for name, *paths in args.engine:
        if not paths:
            parser.error(f"--engine {name}: no result files")
        engines[name] = load_points(paths)
    rows = compare(engines)
    plot(engines, args.title, args.out)
    doc = {"title": args.title,
           "engines": {n: [{**p, "request_rate": "inf" if math.isinf(p["request_rate"])
                            else p["request_rate"]} for p in pts]
                       for n, pts in engines.items()},
           "ratios": rows}
    json_path = os.path.splitext(args.out)[0] + ".json"
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    for r in rows:
        print(f"rate {r['request_rate']}: {r['engine']}/{r['baseline']} output tok/s "
              f"{r['output_throughput_ratio']:.2f}x, TTFT p50 {r['ttft_p50_ratio'] or 0:.2f}x "
              f"p99 {r['ttft_p99_ratio'] or 0:.2f}x, ITL p99 {r['itl_p99_ratio'] or 0:.2f}x")
    print(f"wrote {args.out} and {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
