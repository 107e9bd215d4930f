"""Shared pieces of the `pyorch bench` commands: engine-argument flags, random prompts, the
environment record, result files and percentiles.

Every benchmark writes one JSON document::

    {"benchmark": NAME, "args": {...}, "env": {...}, "rows": [...], "summary": {...}}

by default to ``bench/results/<device name>/<NAME>.json`` (relative to the working directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import subprocess
import time
from typing import Any, Optional, Sequence

RESULTS_ROOT = os.path.join("bench", "results")

# EngineArgs fields a benchmark sets itself (or that make no sense as a flag).
_NOT_FLAGS = {"model"}


# ---- engine arguments --------------------------------------------------------------------------
def _flag_type(annotation: str) -> tuple[Any, bool]:
    """(element type, is a list) for an EngineArgs annotation string such as Optional[list[int]]."""
    ann = annotation.replace(" ", "")
    ann = ann[len("Optional["):-1] if ann.startswith("Optional[") else ann
    is_list = ann.startswith("list[")
    ann = ann[len("list["):-1] if is_list else ann
    return {"int": int, "float": float, "bool": bool}.get(ann, str), is_list


def add_engine_args(parser: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    """Adds `--model` and one `--kebab-case` flag per `EngineArgs` field (vLLM's names).

    Flags default to None ("not given") so that `engine_kwargs` passes on only what the user set
    and the engine keeps its own defaults."""
    from pyorch.engine.arg_utils import EngineArgs

    parser.add_argument("--model", default=None,
                        help="HF directory, .gguf file, or a config folder with --load-format "
                             "dummy (default: the embedded SmolLM2-135M-Instruct GGUF)")
    group = parser.add_argument_group("engine arguments (pyorch.engine.arg_utils.EngineArgs)")
    for field in dataclasses.fields(EngineArgs):
        if field.name in _NOT_FLAGS or field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind, is_list = _flag_type(str(field.type))
        if is_list:
            group.add_argument(flag, dest=field.name, type=kind, nargs="+", default=None,
                               help=f"(engine default: {field.default})")
        elif kind is bool:
            group.add_argument(flag, dest=field.name, default=None,
                               action=argparse.BooleanOptionalAction,
                               help=f"(engine default: {field.default})")
        else:
            group.add_argument(flag, dest=field.name, type=kind, default=None,
                               help=f"(engine default: {field.default})")


def engine_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """The EngineArgs keyword arguments the user gave (None = not given), plus `overrides`."""
    from pyorch.engine.arg_utils import EngineArgs

    kwargs = {name: getattr(args, name) for name in EngineArgs.field_names()
              if name != "model" and getattr(args, name, None) is not None}
    kwargs.update(overrides)
    return kwargs


def resolve_device(device: Optional[str]) -> str:
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_model(model: Optional[str]) -> str:
    from pyorch.model_loader import default_model_path

    return model or default_model_path()


# ---- workload ----------------------------------------------------------------------------------
def random_lengths(mean: int, range_ratio: float, num: int, seed: int) -> list[int]:
    """`num` lengths drawn uniformly from [mean*(1-r), mean*(1+r)] (vLLM's --random-range-ratio);
    all equal to `mean` when r is 0. Never below 1."""
    import numpy as np

    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    if mean < 1:
        raise ValueError(f"length must be >= 1, got {mean}")
    low = max(1, int(math.floor(mean * (1 - range_ratio))))
    high = max(low, int(math.ceil(mean * (1 + range_ratio))))
    rng = np.random.default_rng(seed)
    return [int(n) for n in rng.integers(low, high + 1, size=num)]


def random_token_prompts(lengths: Sequence[int], vocab_size: int, seed: int,
                         low_id: int = 0) -> list[list[int]]:
    """One prompt of random token ids in [low_id, vocab_size) per length (fixed seed)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(low_id, vocab_size, size=n).tolist() for n in lengths]


# ---- environment -------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def results_dir(device: str) -> str:
    """bench/results/<device name>/, the name as the existing H100 folder spells it."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name(device)).strip("_")
    return os.path.join(RESULTS_ROOT, name)


def _git_commit() -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "pyorch_commit": _git_commit(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if hasattr(os, "getloadavg"):
        env["load_avg_at_start"] = list(os.getloadavg())
    if device.startswith("cuda"):
        env["cuda"] = torch.version.cuda
        props = torch.cuda.get_device_properties(torch.device(device))
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return env


# ---- results -----------------------------------------------------------------------------------
def output_paths(name: str, device: str, output_json: Optional[str]) -> tuple[str, str]:
    """(json path, png path): `--output-json PATH` (the PNG beside it) or the default folder."""
    path = output_json or os.path.join(results_dir(device), f"{name}.json")
    return path, os.path.splitext(path)[0] + ".png"


def write_json(path: str, doc: dict[str, Any]) -> None:
    if hasattr(os, "getloadavg"):
        doc.setdefault("env", {})["load_avg_at_end"] = list(os.getloadavg())
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_strict_json(doc), f, indent=2, default=str, allow_nan=False)
        f.write("\n")
    print(f"wrote {path}")


def _strict_json(value: Any) -> Any:
    """Plain JSON has no inf/nan: inf becomes the string "inf", nan becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def args_dict(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}


def pyplot() -> Any:
    """matplotlib.pyplot with the Agg backend, imported only when a figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def shape_label(batch: int, context: int) -> str:
    """'64 x 4k' for batch 64 at a 4096-token context (contexts off a multiple of 1024 as is)."""
    ctx = f"{context // 1024}k" if context % 1024 == 0 else str(context)
    return f"{batch} x {ctx}"


def plot_grouped_bars(
    path: str,
    labels: Sequence[str],
    series: dict[str, Sequence[Optional[float]]],
    targets: Sequence[Optional[float]],
    ylabel: str,
    title: str,
    xlabel: str = "batch x context",
) -> None:
    """One group of bars per label (a series' None leaves its bar out), each bar with its value,
    and a dashed target tick over a group where `targets` has one."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        pts = [(i, v) for i, v in enumerate(values) if v is not None]
        xs = [i + (k - (len(series) - 1) / 2) * width for i, _ in pts]
        bars = ax.bar(xs, [v for _, v in pts], width, label=name)
        for bar, (_, v) in zip(bars, pts, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom",
                    fontsize=7)
    labelled = False
    for i, target in enumerate(targets):
        if target is not None:
            ax.hlines(target, i - 0.45, i + 0.45, colors="black", linestyles="--",
                      label=None if labelled else "target")
            labelled = True
    ax.set_xticks(range(len(labels)), list(labels))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- statistics --------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default method). NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def decode_ms_per_token(llm: Any, new_tokens: int, repeats: int,
                        prompt_token_ids: Sequence[int]) -> list[float]:
    """Batch-1 decode time per token of `llm` (an LLM), one sample per repeat: (a 1 + new_tokens
    token greedy generation - a 1 token one) / new_tokens, ignore_eos, after one warm-up run."""
    from pyorch import SamplingParams

    prompt = [{"prompt_token_ids": list(prompt_token_ids)}]

    def run(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - start

    run(new_tokens + 1)
    return [(run(new_tokens + 1) - run(1)) * 1e3 / new_tokens for _ in range(repeats)]


def parse_int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, comma-separated: {text!r}")
    return values


def format_phases(phases: dict[str, float]) -> str:
    """One line of an engine step's phases in ms (StepTimings.per_step_ms)."""
    from pyorch.metrics.stats import StepTimings

    return " ".join(f"{k} {phases[k]:.2f}" for k in StepTimings.PHASES)
