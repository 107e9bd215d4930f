"""Plots bench_custom_all_reduce's JSON: latency and bus bandwidth of pyorch's custom all-reduce
(one-shot, two-shot, auto) against NCCL per message size, and checks issue 23's targets for the
sizes the engine gives the kernel (up to --max-custom-bytes): auto no slower than NCCL at every
such size, and >= 1.5x faster at 16-256 KiB (the decode sizes).

    python bench/probes/plot_all_reduce.py RESULT.json --out PREFIX [--max-custom-bytes N]

Writes PREFIX.png (two panels) and prints one verdict line per target; exits 1 if one fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DECODE_SIZES = (16 << 10, 256 << 10)
DECODE_SPEEDUP = 1.5
IMPLS = ("nccl", "one_shot_push", "one_shot", "two_shot", "auto")


def series(rows: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, float]]]:
    """{algo: {bytes: row}} of the all-reduce rows (NCCL under "nccl")."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for row in rows:
        if row.get("op") != "all_reduce":
            continue
        out.setdefault(str(row["algo"]), {})[int(row["bytes"])] = row
    return out


def verdicts(data: dict[str, dict[int, dict[str, float]]], max_custom_bytes: int) -> list[
        tuple[str, bool]]:
    """(description, passed) per target; the kernel's "auto" rows against NCCL's."""
    auto, nccl = data.get("auto", {}), data.get("nccl", {})
    sizes = sorted(b for b in auto if b in nccl and b <= max_custom_bytes)
    if not sizes:
        return [("no size has both auto and nccl rows", False)]
    wrong = sum(int(data[a][b].get("wrong", 0)) for a in data for b in data[a])
    result = [(f"every result exact ({wrong} wrong elements)", wrong == 0)]
    slower = [b for b in sizes if auto[b]["time_us"] > nccl[b]["time_us"]]
    result.append((f"auto <= NCCL at all {len(sizes)} sizes up to {max_custom_bytes} bytes"
                   + (f" (slower at {slower})" if slower else ""), not slower))
    decode = [b for b in sizes if DECODE_SIZES[0] <= b <= DECODE_SIZES[1]]
    speedups = {b: nccl[b]["time_us"] / auto[b]["time_us"] for b in decode}
    low = {b: round(s, 2) for b, s in speedups.items() if s < DECODE_SPEEDUP}
    result.append((f">= {DECODE_SPEEDUP}x NCCL at 16-256 KiB: "
                   + ", ".join(f"{b >> 10} KiB {s:.2f}x" for b, s in speedups.items()),
                   bool(decode) and not low))
    return result


def plot(data: dict[str, dict[int, dict[str, float]]], out_png: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, bw) = plt.subplots(1, 2, figsize=(13, 5))
    for name in IMPLS:
        if name not in data:
            continue
        sizes = sorted(data[name])
        lat.plot(sizes, [data[name][b]["time_us"] for b in sizes], marker="o", label=name)
        bw.plot(sizes, [data[name][b]["busbw_GBs"] for b in sizes], marker="o", label=name)
    for ax, label in ((lat, "latency (us, median)"), (bw, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    lat.set_yscale("log")
    lat.axvspan(*DECODE_SIZES, color="green", alpha=0.08, label="decode sizes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json_file")
    parser.add_argument("--out", required=True, help="output prefix (PREFIX.png)")
    parser.add_argument("--max-custom-bytes", type=int, default=64 << 20,
                        help="largest message the engine gives the kernel (default: 64 MiB, "
                             "custom_all_reduce.MAX_BYTES_BY_WORLD_SIZE[2])")
    args = parser.parse_args(argv)
    with open(args.json_file) as f:
        rows = json.load(f)
    data = series(rows)
    first = next(iter(rows), {})
    title = (f"all-reduce, {first.get('ranks', '?')} x {first.get('device', '?')}, "
             f"{first.get('dtype', '?')}")
    plot(data, args.out + ".png", title)
    ok = True
    for text, passed in verdicts(data, args.max_custom_bytes):
        print(f"{'PASS' if passed else 'FAIL'}: {text}")
        ok &= passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
