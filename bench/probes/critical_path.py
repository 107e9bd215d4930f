"""What each kernel adds to a step's GPU time when kernels overlap (PDL), from a torch.profiler
Chrome trace (bench/profile_gpu.py --out DIR writes one).

Under programmatic dependent launch a kernel starts while the one before it drains and waits in
griddepcontrol.wait, so its profiled duration includes that wait: summing durations overcounts.
Here the kernels are taken in start order and each is charged only for how far it moves the
latest end time so far (its "marginal"); a gap where no kernel runs is charged as idle before
the kernel that ends it. Marginals plus idle add up to the span from the first kernel's start to
the last kernel's end, so the table says where a step's wall time goes on the device.

    python bench/probes/critical_path.py TRACE.json [--steps N] [--top 30]

Kernels are grouped by name and launch grid (so the same GEMM kernel at different shapes stays
apart). --steps divides the totals by the number of steps profiled.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any


def kernel_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = [e for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(out, key=lambda e: (float(e["ts"]), float(e.get("dur", 0.0))))


def short_name(e: dict[str, Any]) -> str:
    name = str(e["name"])
    for prefix in ("void ", "pyorch::kernels::"):
        name = name.replace(prefix, "")
    cut = name.find("(")
    if cut > 0:
        name = name[:cut]
    if len(name) > 60:
        name = name[:57] + "..."
    grid = e.get("args", {}).get("grid")
    return f"{name} {tuple(grid)}" if grid else name


def charge(events: list[dict[str, Any]]) -> tuple[dict[str, dict[str, float]], float, float]:
    """Per group: count, summed duration, summed marginal, summed idle before; plus the span
    and the total idle."""
    table: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    latest = None
    idle_total = 0.0
    for e in events:
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        end = ts + dur
        row = table[short_name(e)]
        row["count"] += 1
        row["dur"] += dur
        if latest is None:
            row["marginal"] += dur
            latest = end
            continue
        idle = max(0.0, ts - latest)
        row["idle"] += idle
        idle_total += idle
        row["marginal"] += max(0.0, end - max(latest, ts))
        latest = max(latest, end)
    span = (latest or 0.0) - float(events[0]["ts"]) if events else 0.0
    return table, span, idle_total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=1, help="steps in the trace (divides totals)")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    with open(args.trace) as f:
        events = kernel_events(json.load(f))
    table, span, idle = charge(events)
    n = max(args.steps, 1)
    print(f"{len(events)} kernels, span {span / n:.1f} us/step, idle {idle / n:.1f} us/step, "
          f"summed durations {sum(r['dur'] for r in table.values()) / n:.1f} us/step")
    print(f"{'kernel (grid)':<80} {'calls':>6} {'dur us':>8} {'marg us':>8} {'idle us':>8} "
          f"{'marg/step':>10}")
    rows = sorted(table.items(), key=lambda kv: -(kv[1]["marginal"] + kv[1]["idle"]))
    for name, r in rows[:args.top]:
        c = r["count"]
        print(f"{name:<80} {c / n:>6.0f} {r['dur'] / c:>8.2f} {r['marginal'] / c:>8.2f} "
              f"{r['idle'] / c:>8.2f} {(r['marginal'] + r['idle']) / n:>10.1f}")


if __name__ == "__main__":
    main()
