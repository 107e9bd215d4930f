"""Plots of `build/cuda/bench_paged_attention` results against issue 5's targets.

    python bench/probes/plot_paged_attention.py decode JSON [--key K] --out PREFIX
    python bench/probes/plot_paged_attention.py prefill JSON [--key K] --sdpa-from TXT \
        [--head-size 128] --out PREFIX

JSON is the binary's --json output (a list of rows), or a dict of such lists (one per variant or
run): --key picks one, else the first. `decode` draws % of copy bandwidth per (batch, context),
timed three ways (one direct call, one call replayed from a graph, 20 calls per graph from HBM),
with the targets at 64 x 4k and 1 x 32k. `prefill` draws TFLOP/s per shape beside torch SDPA's
flash backend on the same shapes, read from the `op=torch_sdpa_flash ...` lines
bench/sdpa_prefill.py printed into TXT in the same run, with the target at 8k. Writes PREFIX.json
(the plotted numbers) and PREFIX.png.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any, Optional

DECODE_TARGETS = {(64, 4096): 90.0, (1, 32768): 75.0}  # % of copy
PREFILL_TARGET = (8192, 450.0)  # TFLOP/s, causal, head 128
_KV = re.compile(r"(\S+?)=(\S+)")


def _rows(path: str, key: Optional[str]) -> list[dict[str, Any]]:
    with open(path) as f:
        doc = json.load(f)
    if isinstance(doc, list):
        return doc
    lists = {k: v for k, v in doc.items() if isinstance(v, list)}
    if not lists:
        raise SystemExit(f"{path}: no list of rows")
    if key is None:
        return next(iter(lists.values()))
    if key not in lists:
        raise SystemExit(f"{path}: no key {key!r} (have {sorted(lists)})")
    return lists[key]


def sdpa_rows(txt: str, head_size: int) -> dict[tuple[int, int], float]:
    """(batch, context) -> TFLOP/s of the first `op=torch_sdpa_flash` line per shape."""
    out: dict[tuple[int, int], float] = {}
    with open(txt) as f:
        for line in f:
            if not line.startswith("op=torch_sdpa_flash"):
                continue
            kv = dict(_KV.findall(line))
            if int(kv.get("head_size", -1)) != head_size:
                continue
            out.setdefault((int(kv["batch"]), int(kv["context"])), float(kv["TFLOP/s"]))
    return out


def decode_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"batch": r["batch"], "context": r["context"], "direct": r["pct_of_copy"],
             "graph": r["graph_pct_of_copy"], "steady": r.get("steady_pct_of_copy"),
             "target": DECODE_TARGETS.get((r["batch"], r["context"]))}
            for r in rows if r.get("mode") == "decode"]


def prefill_table(rows: list[dict[str, Any]], sdpa: dict[tuple[int, int], float],
                  head_size: int) -> list[dict[str, Any]]:
    return [{"batch": r["batch"], "context": r["context"], "pyorch": r["TFLOP/s"],
             "sdpa_flash": sdpa.get((r["batch"], r["context"])),
             "target": PREFILL_TARGET[1] if r["context"] == PREFILL_TARGET[0] else None}
            for r in rows if r.get("mode") == "prefill" and r.get("head_size") == head_size]


def plot(path: str, table: list[dict[str, Any]], series: list[str], ylabel: str,
         title: str) -> None:
    from pyorch.benchmarks.common import plot_grouped_bars, shape_label

    plot_grouped_bars(path, [shape_label(r["batch"], r["context"]) for r in table],
                      {name: [r.get(name) for r in table] for name in series},
                      [r.get("target") for r in table], ylabel, title)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("decode", "prefill"))
    parser.add_argument("json")
    parser.add_argument("--key", default=None)
    parser.add_argument("--sdpa-from", default=None)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--title", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = _rows(args.json, args.key)
    if args.mode == "decode":
        table = decode_table(rows)
        series = ["direct", "graph", "steady"]
        ylabel = "% of copy bandwidth"
        title = args.title or "paged_attention decode, Llama-3-8B shapes (32/8 heads x 128), bf16"
    else:
        if not args.sdpa_from:
            raise SystemExit("prefill needs --sdpa-from TXT (the run's torch_sdpa_flash lines)")
        table = prefill_table(rows, sdpa_rows(args.sdpa_from, args.head_size), args.head_size)
        series = ["pyorch", "sdpa_flash"]
        ylabel = "TFLOP/s (causal)"
        title = args.title or f"causal prefill, 32/8 heads x {args.head_size}, bf16"
    if not table:
        raise SystemExit(f"no {args.mode} rows in {args.json}")
    with open(args.out + ".json", "w") as f:
        json.dump({"source": args.json, "key": args.key, "rows": table}, f, indent=1)
    plot(args.out + ".png", table, series, ylabel, title)
    print(f"wrote {args.out}.json, {args.out}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
