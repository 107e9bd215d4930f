"""pyorch's gptq_marlin_gemm against vLLM's (Marlin) on the same GPU, the same random GPTQ weights
(uint4b8, group 128, bf16) and the same timing: Llama-3-8B / 70B projections, M = 1..64.

    PYTHONPATH=/tmp/site:$PWD python bench/w4a16_vs_vllm.py --json OUT.json

Each side runs a CUDA graph of --launches back-to-back GEMMs over enough weight copies that no
launch finds its weight in L2; the median replay over --iters, per launch. vLLM's op is called
through its registered schema with arguments matched by name (its signature changes between
releases); use_fp32_reduce and use_atomic_add as vLLM's own linear method picks them. Both
outputs are checked against the dequantized weight (cuBLAS on the bf16 copy) before timing.
vLLM's ops come from `import vllm._custom_ops` (which loads vllm/_C) or, when the vllm package
does not import, from loading vllm/_C*.so directly (torch.ops.load_library) with the two small
marlin_utils helpers done here. Without either, only pyorch's rows are printed (and why).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Callable

import torch

from pyorch import _ops
from pyorch.scalar_type import scalar_types

SHAPES = [  # (model, name, N, K)
    ("8b", "qkv_proj", 6144, 4096), ("8b", "o_proj", 4096, 4096),
    ("8b", "gate_up", 28672, 4096), ("8b", "down", 4096, 14336),
    ("70b", "qkv_proj", 10240, 8192), ("70b", "o_proj", 8192, 8192),
    ("70b", "gate_up", 57344, 8192), ("70b", "down", 8192, 28672),
]
GROUP = 128


def _time_us(fn: Callable[[int], None], copies: int, launches: int, iters: int) -> float:
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(launches):  # warm-up on the capture stream
            fn(i % copies)
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(launches):
                fn(i % copies)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


class _OwnMarlinUtils:
    """The three helpers this script takes from vLLM's marlin_utils, written from their documented
    behaviour, for when vLLM's Python package does not import but its compiled ops (vllm/_C) load:
    a zeroed int32 workspace of one lock per SM, and Marlin's scale layout (within each 64 scale
    columns, column 8 i + j moves to 8 j + i for grouped scales; per-channel scales interleave
    pairs of 8-column blocks)."""

    @staticmethod
    def marlin_make_workspace_new(device: torch.device) -> torch.Tensor:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return torch.zeros(sms, dtype=torch.int32, device=device)

    @staticmethod
    def marlin_permute_scales(s: torch.Tensor, size_k: int, size_n: int,
                              group_size: int) -> torch.Tensor:
        if 0 < group_size < size_k:
            order = [8 * j + i for i in range(8) for j in range(8)]
        else:
            order = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
        return s.reshape(-1, len(order))[:, order].reshape(-1, size_n).contiguous()


def _load_vllm_ops() -> str:
    """Loads vLLM's compiled ops (vllm/_C*.so, which registers torch.ops._C) without importing
    the vllm package; returns the library's path."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("no vllm package on sys.path (PYTHONPATH=/tmp/site?)")
    for root in spec.submodule_search_locations:
        libs = sorted(glob.glob(f"{root}/_C*.so"))
        if libs:
            torch.ops.load_library(libs[0])
            return libs[0]
    raise ImportError(f"no vllm/_C*.so under {list(spec.submodule_search_locations)}")


def _marlin_op() -> Any:
    """vLLM's Marlin GEMM op: `_C::gptq_marlin_gemm`, named `_C::marlin_gemm` in vLLM 0.26 (with
    more optional arguments: bias, activation scales, ...); None when neither is registered."""
    for name in ("gptq_marlin_gemm", "marlin_gemm"):
        if hasattr(torch.ops._C, name):
            return getattr(torch.ops._C, name).default
    return None


def _vllm() -> tuple[Any, str]:
    """(marlin helpers, "") with vLLM's ops registered, or (None, why not). vLLM's own
    `vllm._custom_ops` registers torch.ops._C by importing vllm._C (and logs, not raises, when
    that fails); when the package itself does not import, the library is loaded directly."""
    why = ""
    try:
        from vllm import _custom_ops  # noqa: F401
        from vllm.model_executor.layers.quantization.utils import marlin_utils
        if _marlin_op() is None:
            _load_vllm_ops()
        if _marlin_op() is None:
            raise RuntimeError("neither _C::gptq_marlin_gemm nor _C::marlin_gemm is registered")
        return marlin_utils, ""
    except Exception as e:  # noqa: BLE001 - try the library alone, then report why
        why = f"import vllm: {type(e).__name__}: {e}"
    try:
        path = _load_vllm_ops()
        if _marlin_op() is None:
            raise RuntimeError("neither _C::gptq_marlin_gemm nor _C::marlin_gemm is registered")
        print(f"vLLM package import failed ({why}); loaded its ops from {path}", flush=True)
        return _OwnMarlinUtils(), ""
    except Exception as e:  # noqa: BLE001
        return None, f"{why}; loading vllm/_C: {type(e).__name__}: {e}"


def _vllm_gemm(mu: Any, n: int, k: int) -> tuple[Callable[..., torch.Tensor], Any, Any]:
    """(gemm(a, qweight_marlin, scales_marlin) -> out, repack(qweight) , permute_scales)."""
    op = _marlin_op()
    names = [a.name for a in op._schema.arguments]
    workspace = (mu.marlin_make_workspace_new(torch.device("cuda"))
                 if hasattr(mu, "marlin_make_workspace_new")
                 else mu.marlin_make_workspace(n, torch.device("cuda")))
    # vLLM's own scalar type ids (its encoding may differ from pyorch's copy of ScalarType).
    try:
        from vllm.scalar_type import scalar_types as vllm_scalar_types
        qtype = vllm_scalar_types.uint4b8
    except ImportError:
        qtype = scalar_types.uint4b8

    def gemm(a: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        m = a.shape[0]
        atomic = False
        if hasattr(mu, "should_use_atomic_add_reduce"):
            atomic = mu.should_use_atomic_add_reduce(m=m, n=n, k=k, device=a.device,
                                                     dtype=a.dtype)
        values = dict(a=a, b_q_weight=qw, b_scales=scales, workspace=workspace,
                      b_q_type=qtype.id, b_q_type_id=qtype.id, b_type_id=qtype.id, size_m=m,
                      size_n=n, size_k=k,
                      is_k_full=True, use_atomic_add=atomic, use_fp32_reduce=True,
                      is_zp_float=False)
        args = []
        for arg in op._schema.arguments:
            if arg.name in values:
                args.append(values[arg.name])
            elif "Optional" in str(arg.type) or "?" in str(arg.type):
                args.append(None)
            else:
                raise RuntimeError(f"vLLM {op._schema.name} argument {arg.name} ({arg.type})")
        return op(*args)

    def repack(qweight: torch.Tensor) -> torch.Tensor:
        perm = torch.empty(0, dtype=torch.int32, device="cuda")
        op = torch.ops._C.gptq_marlin_repack.default
        extra = [False] * (len(op._schema.arguments) - 5)  # 0.26: is_a_8bit (16-bit a here)
        return op(qweight, perm, k, n, 4, *extra)

    def permute_scales(scales: torch.Tensor) -> torch.Tensor:
        return mu.marlin_permute_scales(scales, size_k=k, size_n=n, group_size=GROUP)

    print(f"vLLM {op._schema.name} arguments: {names}", flush=True)
    return gemm, repack, permute_scales


def _bench_shape(mu: Any, model: str, name: str, n: int, k: int, tokens: list[int],
                 launches: int, iters: int) -> list[dict[str, Any]]:
    copies = max(2, int(200e6 // (n * k // 2)) + 1)
    gptq = [torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda")
            for _ in range(copies)]
    scales = (torch.rand(k // GROUP, n, device="cuda") * 0.02 + 0.005).to(torch.bfloat16)
    ours_w = [_ops.gptq_marlin_repack(q, None, k, n, 4) for q in gptq]
    ws = _ops.w4a16_make_workspace(n, torch.device("cuda"))
    vllm_gemm: Callable[..., torch.Tensor] | None = None
    vllm_w: list[torch.Tensor] = []
    vllm_s = scales
    if mu is not None:
        try:
            vllm_gemm, repack, permute = _vllm_gemm(mu, n, k)
            vllm_w = [repack(q) for q in gptq]
            vllm_s = permute(scales)
        except Exception as e:  # noqa: BLE001
            print(f"vLLM setup failed on {model} {name}: {type(e).__name__}: {e}", flush=True)
            vllm_gemm = None
    # The reference weight from GPTQ's definition: W[k, n] = (q - 8) * s, rounded to bf16.
    q0 = gptq[0].to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(q0 >> (4 * i)) & 0xF for i in range(8)], 1).reshape(k, n)
    w_ref = ((codes - 8).to(torch.float32) * scales.float().repeat_interleave(GROUP, 0))
    w_ref = w_ref.to(torch.bfloat16).float()
    del q0, codes
    rows = []
    qtype = scalar_types.uint4b8
    for m in tokens:
        a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        expected = a.float() @ w_ref
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

        def ours(i: int, a: torch.Tensor = a, out: torch.Tensor = out, m: int = m) -> None:
            _ops.gptq_marlin_gemm(a, out, ours_w[i], scales, None, None, ws, qtype, m, n, k)

        ours(0)
        err = float((out.float() - expected).abs().max() / expected.abs().max())
        row: dict[str, Any] = dict(model=model, shape=name, M=m, N=n, K=k,
                                   pyorch_us=_time_us(ours, copies, launches, iters),
                                   pyorch_rel_err=err)
        if vllm_gemm is not None:
            gemm = vllm_gemm
            got = gemm(a, vllm_w[0], vllm_s)
            row["vllm_rel_err"] = float((got.float() - expected).abs().max()
                                        / expected.abs().max())

            def theirs(i: int, a: torch.Tensor = a,
                       gemm: Callable[..., torch.Tensor] = gemm) -> None:
                gemm(a, vllm_w[i], vllm_s)

            row["vllm_us"] = _time_us(theirs, copies, launches, iters)
            row["speedup_vs_vllm"] = row["vllm_us"] / row["pyorch_us"]
        row["weight_GB/s"] = (n * k / 2 + 2 * n * k / GROUP) / (row["pyorch_us"] * 1e3)
        rows.append(row)
        print(" ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
                       for key, val in row.items()), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="8b,70b")
    p.add_argument("--tokens", default="1,2,4,8,16,32,64")
    p.add_argument("--launches", type=int, default=20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default="")
    args = p.parse_args()
    mu, why = _vllm()
    if mu is None:
        print(f"vLLM not importable ({why}): pyorch only", flush=True)
    rows: list[dict[str, Any]] = []
    torch.manual_seed(0)
    tokens = [int(t) for t in args.tokens.split(",")]
    for model, name, n, k in SHAPES:
        if model in args.models.split(","):
            rows += _bench_shape(mu, model, name, n, k, tokens, args.launches, args.iters)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
