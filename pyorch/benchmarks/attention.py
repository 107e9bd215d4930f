"""`pyorch bench attention`: decode attention on the same data in the same run, as a percentage of
the device-to-device copy bandwidth measured in that run.

For each (batch, context) row, one random KV cache is laid out three ways and every op reads the
same values:

* ``pyorch``: ``torch.ops.pyorch.paged_attention`` on the NHD paged cache
  ``[num_blocks, block_size, num_kv_heads, head_size]`` through a shuffled block table;
* ``paged_attention_v2``: pyorch's vLLM-layout op (``[num_blocks, num_kv_heads, head_size/x,
  block_size, x]`` keys, ``[num_blocks, num_kv_heads, head_size, block_size]`` values);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)`` on a contiguous
  ``[batch, num_kv_heads, context, head_size]`` copy (no paging: an upper bound for what a
  contiguous-KV kernel in torch reaches); the backend torch picks is recorded.

Timing (CUDA events): ``eager`` is one call on an idle GPU (launch latency included, median of
``--iters``); ``graph`` replays one CUDA graph of 20 calls and divides, cycling through copies of
the inputs that together exceed 256 MB, so the KV comes from HBM and launch latency is hidden, as
inside a model's forward pass. Bytes counted: KV read + query read + output written.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Optional, Sequence

import torch

from pyorch.benchmarks import common

NAME = "attention"
GRAPH_CALLS = 20
ROTATION_BYTES = 256e6  # inputs cycled through by the graph timing: several times the 50 MB L2


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=common.parse_int_list, default=[64, 256, 1, 16, 1])
    parser.add_argument("--context", type=common.parse_int_list,
                        default=[4096, 2048, 32768, 1024, 4096],
                        help="one per --batch entry, or one for all")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--ops", default="pyorch,paged_attention_v2,sdpa",
                        help="comma-separated subset of pyorch,paged_attention_v2,sdpa")
    parser.add_argument("--output-json", default=None,
                        help="result file (default bench/results/<device>/attention.json)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--replot", default=None, metavar="JSON",
                        help="draw the PNG of an earlier run's JSON (beside it) and exit; no GPU")


def copy_bandwidth(num_bytes: int = 2**30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), CUDA events."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = event_times(lambda: dst.copy_(src), iters, warmup=3)
    return 2 * num_bytes / (common.median(ms) * 1e-3)


def event_times(fn: Callable[[], Any], iters: int, warmup: int = 5) -> list[float]:
    """Milliseconds of each of `iters` calls of fn, each between two events on an idle stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def graph_ms(fn: Callable[[], Any], iters: int) -> float:
    """Median ms of one replay of a CUDA graph holding one call of fn (warmed up first on a side
    stream, outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return common.median(event_times(graph.replay, iters))


def _graph_ms_per_call(calls: list[Callable[[], Any]], iters: int) -> float:
    """One CUDA graph of GRAPH_CALLS calls (cycling through `calls`), replayed: ms per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            calls[i % len(calls)]()
    ms = event_times(graph.replay, max(3, iters // 3), warmup=2)
    return common.median(ms) / GRAPH_CALLS


class Row:
    """The inputs of one (batch, context) row in the three layouts, `copies` times over."""

    def __init__(self, args: argparse.Namespace, batch: int, context: int, copies: int) -> None:
        dtype = getattr(torch, args.dtype)
        h, kvh, d, bs = args.num_heads, args.num_kv_heads, args.head_size, args.block_size
        self.batch, self.context, self.scale = batch, context, 1.0 / math.sqrt(d)
        blocks_per_seq = math.ceil(context / bs)
        num_blocks = batch * blocks_per_seq
        gen = torch.Generator(device="cuda").manual_seed(0)
        perm = torch.randperm(num_blocks, device="cuda", generator=gen)
        self.block_table = perm.view(batch, blocks_per_seq).to(torch.int32)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        self.query = torch.randn(batch, h, d, dtype=dtype, device="cuda", generator=gen)
        self.one = torch.ones(1, dtype=torch.float32, device="cuda")
        self.nhd, self.split, self.contig = [], [], []
        x = 16 // self.query.element_size()
        for _ in range(copies):
            k = torch.randn(num_blocks, bs, kvh, d, dtype=dtype, device="cuda", generator=gen)
            v = torch.randn(num_blocks, bs, kvh, d, dtype=dtype, device="cuda", generator=gen)
            self.nhd.append((k, v))
            # vLLM's split layout of the same values.
            k_split = k.view(num_blocks, bs, kvh, d // x, x).permute(0, 2, 3, 1, 4).contiguous()
            v_split = v.permute(0, 2, 3, 1).contiguous()
            self.split.append((k_split, v_split))
            # Contiguous [batch, kv_heads, context, d]: the blocks gathered in table order.
            table = self.block_table.long()
            k_c = k[table].reshape(batch, blocks_per_seq * bs, kvh, d)[:, :context]
            v_c = v[table].reshape(batch, blocks_per_seq * bs, kvh, d)[:, :context]
            self.contig.append((k_c.transpose(1, 2).contiguous(), v_c.transpose(1, 2).contiguous()))
        self.kv_bytes = 2 * batch * context * kvh * d * self.query.element_size()
        self.io_bytes = 2 * self.query.numel() * self.query.element_size()
        parts = math.ceil(context / 512)
        self.exp_sums = torch.empty(batch, h, parts, dtype=torch.float32, device="cuda")
        self.max_logits = torch.empty_like(self.exp_sums)
        self.tmp_out = torch.empty(batch, h, parts, d, dtype=dtype, device="cuda")
        self.out = {op: torch.empty_like(self.query) for op in ("pyorch", "paged_attention_v2")}
        self.args = args

    def call(self, op: str, copy: int) -> Callable[[], Any]:
        args = self.args
        if op == "pyorch":
            k, v = self.nhd[copy]
            return lambda: torch.ops.pyorch.paged_attention(
                self.out[op], self.query, k, v, self.query_start_loc, self.seq_lens,
                self.block_table, 1, self.context, self.scale, True, 0, 0.0, "auto", self.one,
                self.one)
        if op == "paged_attention_v2":
            k, v = self.split[copy]
            return lambda: torch.ops.pyorch.paged_attention_v2(
                self.out[op], self.exp_sums, self.max_logits, self.tmp_out, self.query, k, v,
                args.num_kv_heads, self.scale, self.block_table, self.seq_lens, args.block_size,
                self.context, None, "auto", self.one, self.one, 0, 0, 0, 64, 0)
        k, v = self.contig[copy]
        q = self.query.unsqueeze(2)  # [batch, heads, 1, d]
        return lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, scale=self.scale, enable_gqa=True)

    def result(self, op: str) -> torch.Tensor:
        if op == "sdpa":
            return self.call(op, 0)().squeeze(2)
        self.call(op, 0)()
        return self.out[op]


def _sdpa_backend(row: Row) -> str:
    """The SDPA backend torch's dispatcher picks for this row's call (private torch API; "unknown"
    where it is missing)."""
    choice = getattr(torch, "_fused_sdp_choice", None)
    if choice is None:
        return "unknown"
    k, v = row.contig[0]
    index = choice(row.query.unsqueeze(2), k, v, scale=row.scale, enable_gqa=True)
    from torch.nn.attention import SDPBackend

    names = {b.value: b.name for b in SDPBackend.__members__.values()}
    return names.get(int(index), str(index)).lower()


# The issue-5 targets drawn on the plot: % of copy bandwidth at 64 x 4k and 1 x 32k.
TARGETS = {(64, 4096): 90.0, (1, 32768): 75.0}


def plot(path: str, rows: list[dict[str, Any]], title: str) -> None:
    """Graph-timed % of copy bandwidth per (batch, context), one bar per op; targets as ticks."""
    shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    series: dict[str, Sequence[Optional[float]]] = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        pct = {(r["batch"], r["context"]): r["graph_pct_of_copy"] for r in rows if r["op"] == op}
        series[op] = [pct.get(s) for s in shapes]
    common.plot_grouped_bars(path, [common.shape_label(*s) for s in shapes], series,
                             [TARGETS.get(s) for s in shapes],
                             "% of copy bandwidth (CUDA graph, KV from HBM)", title)
    print(f"wrote {path}")


def _title(doc: dict[str, Any]) -> str:
    a, env = doc["args"], doc.get("env", {})
    return (f"decode attention, {a['num_heads']}/{a['num_kv_heads']} heads x {a['head_size']}, "
            f"block {a['block_size']}, {a['dtype']}, same data ({env.get('device_name', '')})")


def main(args: argparse.Namespace) -> int:
    if args.replot:
        import json
        import os

        with open(args.replot) as f:
            doc = json.load(f)
        plot(os.path.splitext(args.replot)[0] + ".png", doc["rows"], _title(doc))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("pyorch bench attention needs a CUDA device")
    import pyorch._ops  # noqa: F401  (loads the torch.ops.pyorch library)

    contexts = args.context if len(args.context) > 1 else args.context * len(args.batch)
    if len(contexts) != len(args.batch):
        raise SystemExit("--context needs one value per --batch value, or one value")
    ops = [op for op in args.ops.split(",") if op]
    copy_bps = copy_bandwidth()
    print(f"device={torch.cuda.get_device_name()} copy={copy_bps / 1e9:.1f} GB/s (read+written)")
    rows = []
    for batch, context in zip(args.batch, contexts, strict=True):
        kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_size * 2
        copies = min(GRAPH_CALLS, max(1, math.ceil(ROTATION_BYTES / kv_bytes)))
        row = Row(args, batch, context, copies)
        want = row.result("sdpa").float() if "sdpa" in ops else None
        for op in ops:
            eager_ms = common.median(event_times(row.call(op, 0), args.iters))
            calls = [row.call(op, c) for c in range(len(row.nhd))]
            graph_ms = _graph_ms_per_call(calls, args.iters)
            moved = row.kv_bytes + row.io_bytes
            entry = {"op": op, "batch": batch, "context": context, "heads": args.num_heads,
                     "kv_heads": args.num_kv_heads, "head_size": args.head_size,
                     "block_size": args.block_size, "dtype": args.dtype,
                     "eager_us": eager_ms * 1e3, "graph_us": graph_ms * 1e3,
                     "eager_pct_of_copy": 100 * moved / (eager_ms * 1e-3) / copy_bps,
                     "graph_pct_of_copy": 100 * moved / (graph_ms * 1e-3) / copy_bps}
            if want is not None:
                entry["max_abs_diff_vs_sdpa"] = (row.result(op).float() - want).abs().max().item()
            if op == "sdpa":
                entry["sdpa_backend"] = _sdpa_backend(row)
            rows.append(entry)
            print(f"op={op:<18} batch={batch:<4} context={context:<6} "
                  f"eager_us={entry['eager_us']:9.2f} graph_us={entry['graph_us']:9.2f} "
                  f"pct_of_copy eager={entry['eager_pct_of_copy']:5.1f} "
                  f"graph={entry['graph_pct_of_copy']:5.1f}"
                  + (f" max_abs_diff_vs_sdpa={entry['max_abs_diff_vs_sdpa']:.2e}"
                     if "max_abs_diff_vs_sdpa" in entry else ""))
        del row
        torch.cuda.empty_cache()
    device = "cuda"
    json_path, png_path = common.output_paths(NAME, device, args.output_json)
    doc = {"benchmark": NAME, "args": common.args_dict(args), "env": common.environment(device),
           "copy_bytes_per_s": copy_bps, "rows": rows}
    common.write_json(json_path, doc)
    if not args.no_plot:
        plot(png_path, rows, _title(doc))
    return 0
