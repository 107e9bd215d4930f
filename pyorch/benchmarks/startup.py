"""`pyorch bench startup`: cold start to ready, `LLM(...)` built in a fresh Python process.

Each of `--num-iters` runs (after `--num-iters-warmup`, which warms the OS file cache) starts a
new interpreter that imports torch, imports pyorch and builds the `LLM`; the wall time runs from
just before the process is spawned to the moment `LLM(...)` returns. The phases are the child's
own timestamps (interpreter start, `import torch`, `import pyorch`, `LLM(...)`) and every log
record pyorch emits while building (model load, KV cache, CUDA graphs), each with its time.

Baseline, same run: a fresh process that imports torch and moves the same number of weight bytes
to the device (a host buffer filled, then copied: `.to(device)` on CUDA, `.clone()` on the CPU).
It is a floor, not a competitor: nothing real can start faster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from pyorch.benchmarks import common

NAME = "startup"

# Runs in the fresh interpreter: argv[1] = spawn time (time.time()), argv[2] = JSON arguments.
# It imports nothing from pyorch before the clock reads, so import time is measured, not hidden.
_CHILD = r"""
import json, logging, sys, time
t_main = time.time()
spawn, cfg = float(sys.argv[1]), json.loads(sys.argv[2])
records = []
class _Keep(logging.Handler):
    def emit(self, record):
        records.append({"t_s": record.created - spawn, "logger": record.name,
                        "msg": record.getMessage()})
logging.getLogger("pyorch").addHandler(_Keep())
logging.getLogger("pyorch").setLevel(logging.INFO)
import torch
t_torch = time.time()
phases = {"interpreter_s": t_main - spawn, "import_torch_s": t_torch - t_main}
if cfg["kind"] == "pyorch":
    import pyorch
    t_pyorch = time.time()
    if cfg.get("cprofile"):  # where LLM(...) spends its time, by cumulative time per function
        import cProfile, io, pstats
        prof = cProfile.Profile()
        llm = prof.runcall(pyorch.LLM, cfg["model"], **cfg["engine_kwargs"])
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
        with open(cfg["cprofile"], "w") as f:
            f.write(text.getvalue())
    else:
        llm = pyorch.LLM(cfg["model"], **cfg["engine_kwargs"])
    executor = llm.llm_engine.engine_core.model_executor
    runner = getattr(executor, "model_runner", None)
    if runner is None:  # tensor-parallel workers: the floor copies the largest rank's weights
        t_ready = time.time()
        weight_bytes = max(executor.collective_rpc("weight_bytes"))
        dev = torch.device(llm.llm_engine.config.model_config.device)
        graphs = None
    else:
        model = runner.model
        dev = next(model.parameters()).device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t_ready = time.time()
        weight_bytes = runner.weight_bytes()
        graphs = runner.cuda_graphs
    phases.update(import_pyorch_s=t_pyorch - t_torch, llm_init_s=t_ready - t_pyorch)
    result = {"weight_bytes": weight_bytes, "device": str(dev),
              "tensor_parallel_size": llm.llm_engine.config.parallel_config.tensor_parallel_size}
    if graphs is not None:
        result["cuda_graphs"] = {"count": graphs.num_graphs, "capture_s": graphs.capture_seconds,
                                 "pool_bytes": graphs.pool_bytes,
                                 "free_memory_drop_bytes": graphs.memory_bytes}
else:
    dev = torch.device(cfg["device"])
    host = torch.empty(cfg["weight_bytes"], dtype=torch.uint8)
    host.fill_(1)
    t_host = time.time()
    on_dev = host.to(dev) if dev.type == "cuda" else host.clone()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t_ready = time.time()
    phases.update(host_fill_s=t_host - t_torch, copy_to_device_s=t_ready - t_host)
    result = {"weight_bytes": cfg["weight_bytes"], "device": str(dev)}
result.update(total_s=t_ready - spawn, phases=phases, log=records)
print("PYORCH_STARTUP_RESULT " + json.dumps(result), flush=True)
"""

_MARK = "PYORCH_STARTUP_RESULT "


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child")
    parser.add_argument("--cprofile", default=None, metavar="FILE",
                        help="also run one extra cold start under cProfile (not timed) and "
                             "write its top functions by cumulative time to FILE")
    parser.add_argument("--output-json", default=None,
                        help="result file (default bench/results/<device>/startup.json)")
    common.add_engine_args(parser)


def run_child(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Spawns one fresh interpreter and returns the result line it printed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    spawn = time.time()
    proc = subprocess.run([sys.executable, "-c", _CHILD, repr(spawn), json.dumps(config)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise RuntimeError(f"startup child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")


def _medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = runs[0]["phases"].keys()
    out = {k: common.median([r["phases"][k] for r in runs]) for k in keys}
    out["total_s"] = common.median([r["total_s"] for r in runs])
    return out


def main(args: argparse.Namespace) -> int:
    device = common.resolve_device(args.device)
    model = common.resolve_model(args.model)
    env = common.environment(device)
    pyorch_cfg = {"kind": "pyorch", "model": model,
                  "engine_kwargs": common.engine_kwargs(args, device=device)}
    for _ in range(args.num_iters_warmup):
        run_child(pyorch_cfg, args.timeout)
    runs = [run_child(pyorch_cfg, args.timeout) for _ in range(args.num_iters)]
    weight_bytes = runs[0]["weight_bytes"]
    floor_cfg = {"kind": "floor", "device": device, "weight_bytes": weight_bytes}
    floors = [run_child(floor_cfg, args.timeout) for _ in range(args.num_iters)]
    if args.cprofile:
        run_child({**pyorch_cfg, "cprofile": os.path.abspath(args.cprofile)}, args.timeout)
        print(f"wrote {args.cprofile}")
    ours, floor = _medians(runs), _medians(floors)
    ratio = ours["total_s"] / floor["total_s"]
    for name, med in (("pyorch LLM()", ours), ("floor: import torch + weight bytes", floor)):
        parts = ", ".join(f"{k} {v:.2f}" for k, v in med.items() if k != "total_s")
        print(f"{name:>36}: {med['total_s']:.2f} s (median of {args.num_iters}; {parts})")
    print(f"cold start is {ratio:.2f}x the floor ({weight_bytes / 1e9:.3f} GB of weights)")
    for r in runs:
        if "cuda_graphs" in r:
            g = r["cuda_graphs"]
            print(f"CUDA graphs: {g['count']} captured in {g['capture_s']:.2f} s, graph memory "
                  f"pool {g['pool_bytes'] / 2**30:.3f} GiB (free device memory "
                  f"{g['free_memory_drop_bytes'] / 2**30:.3f} GiB lower)")
    rows = [{"kind": "pyorch", **r} for r in runs] + [{"kind": "floor", **r} for r in floors]
    json_path, _ = common.output_paths(NAME, device, args.output_json)
    common.write_json(json_path, {
        "benchmark": NAME, "model": model, "args": common.args_dict(args), "env": env,
        "rows": rows, "summary": {"pyorch_median": ours, "floor_median": floor,
                                  "weight_bytes": weight_bytes, "ratio_to_floor": ratio}})
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cli_args(parser)
    raise SystemExit(main(parser.parse_args()))
