"""The MoE layer alone (router top-k softmax + the two grouped expert GEMMs + the top-k sum) on
Mixtral-8x7B, Qwen3-30B-A3B and Qwen3-235B-A22B layer shapes, bf16 and fp8 experts (per-tensor
scales per expert, activations quantized per tensor on the fly), pyorch against vLLM's
fused_moe side by side when
vLLM imports, bf16, random weights and router logits. Prints one line per (model, M) with both
times, their ratio (vLLM / pyorch: > 1 means pyorch is faster), and the weight-read floor: the
bytes of the experts the batch actually routes to, at the measured device copy bandwidth (bytes
read + written per second, about what a pure read stream reaches). Each layer call is timed
inside a CUDA graph (as the engine runs it: no host launch overhead) and, separately, eagerly.

    python bench/moe.py [--models mixtral,qwen3_moe,qwen3_235b] [--tokens 1,8,64,512,4096,16384]
                        [--dtypes bf16,fp8] [--out F]

pyorch's bf16 layer is fused_experts (it picks the decode kernel or, from 64 tokens, the CUTLASS
grouped GEMM path); its fp8 layer is fused_experts_grouped at every M. `path` names which ran.

Writes JSON to bench/results/<GPU>/moe.json unless --out says otherwise. Also checks that the two
engines' outputs agree (max abs difference, relative to the output's max).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable

import torch

from pyorch import _ops
from pyorch.benchmarks import common
from pyorch.benchmarks.attention import copy_bandwidth, event_times, graph_ms
from pyorch.layers.fused_moe import fused_experts, fused_topk
from pyorch.layers.fused_moe import fused_moe as fm

# name -> (num_experts, top_k, hidden_size, moe_intermediate_size, renormalize)
SHAPES = {
    "mixtral": (8, 2, 4096, 14336, True),
    "qwen3_moe": (128, 8, 2048, 768, True),
    "qwen3_235b": (128, 8, 4096, 1536, True),
}


def _vllm_moe() -> Callable[..., torch.Tensor] | None:
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts as v_experts
        from vllm.model_executor.layers.fused_moe import fused_topk as v_topk
    except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM here"
        print(f"vLLM fused_moe not importable ({type(e).__name__}: {e}); pyorch only")
        return None

    def run(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            top_k: int, renormalize: bool, scales: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
        weights, ids, *_ = v_topk(x, logits, top_k, renormalize)
        if scales is None:
            return v_experts(x, w13, w2, weights, ids)
        try:  # vLLM >= 0.11: a FusedMoEQuantConfig
            from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
            qc = fp8_w8a8_moe_quant_config(w1_scale=scales[0], w2_scale=scales[1],
                                           per_act_token_quant=False)
            return v_experts(x, w13, w2, weights, ids, quant_config=qc)
        except ImportError:
            return v_experts(x, w13, w2, weights, ids, use_fp8_w8a8=True, w1_scale=scales[0],
                             w2_scale=scales[1])

    return run


def _pyorch_moe(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                top_k: int, renormalize: bool,
                scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    weights, ids = fused_topk(logits, top_k, renormalize)
    if scales is not None:
        return fm.fused_experts_grouped(x, w13, w2, weights, ids, w13.shape[0], None, *scales)
    return fused_experts(x, w13, w2, weights, ids, w13.shape[0])


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert per-tensor fp8 e4m3 weights and their float32 scales [E]."""
    scale = w.abs().amax(dim=(1, 2)).float() / _ops.FP8_MAX
    return (w / scale[:, None, None]).to(_ops.FP8_DTYPE), scale


def _time(row: dict[str, Any], name: str, fn: Callable[[], Any], iters: int) -> None:
    row[f"{name}_eager_us"] = common.median(event_times(fn, iters)) * 1e3
    try:
        row[f"{name}_us"] = graph_ms(fn, iters) * 1e3
    except RuntimeError as e:  # a path that cannot be captured: report the eager time
        print(f"{name}: CUDA graph capture failed ({e}); graph time = eager time")
        row[f"{name}_us"] = row[f"{name}_eager_us"]


def _row(model: str, m: int, bandwidth: float, vllm: Callable[..., torch.Tensor] | None,
         iters: int, dtype: str = "bf16") -> dict[str, Any]:
    num_experts, top_k, hidden, inter, renorm = SHAPES[model]
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(m, num_experts, device="cuda", generator=gen)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen)
           / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen)
          / inter**0.5).to(torch.bfloat16)
    scales = None
    if dtype == "fp8":
        (w13, s13), (w2, s2) = _fp8(w13), _fp8(w2)
        scales = (s13, s2)
    _, ids = fused_topk(logits, top_k, renorm)
    active = int(torch.unique(ids).numel())
    weight_bytes = active * 3 * hidden * inter * w13.element_size()
    path = "grouped" if scales is not None or fm._use_grouped_gemm(x, w13, w2) else "fused_moe_gemm"
    row: dict[str, Any] = dict(op="fused_moe", model=model, dtype=dtype, M=m, path=path,
                               num_experts=num_experts, top_k=top_k, hidden=hidden,
                               intermediate=inter, active_experts=active,
                               floor_us=weight_bytes / bandwidth * 1e6)
    ours = _pyorch_moe(x, logits, w13, w2, top_k, renorm, scales)
    _time(row, "pyorch", lambda: _pyorch_moe(x, logits, w13, w2, top_k, renorm, scales), iters)
    row["pyorch_tflops"] = 2 * m * top_k * 3 * hidden * inter / row["pyorch_us"] * 1e-6
    if vllm is not None:
        v = vllm
        try:
            theirs = v(x, logits, w13, w2, top_k, renorm, scales)
        except Exception as e:  # noqa: BLE001 - report, keep pyorch's numbers
            print(f"vLLM fused_moe failed on {model} {dtype} M={m}: {type(e).__name__}: {e}")
            return row
        scale = theirs.float().abs().max().clamp_min(1e-6)
        row["max_rel_diff"] = float((ours.float() - theirs.float()).abs().max() / scale)
        _time(row, "vllm", lambda: v(x, logits, w13, w2, top_k, renorm, scales), iters)
        row["ratio"] = row["vllm_us"] / row["pyorch_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mixtral,qwen3_moe,qwen3_235b")
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--tokens", default="1,8,64,512,4096,16384")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/<GPU>/)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    vllm = None if args.no_vllm else _vllm_moe()
    out = args.out or os.path.join(common.results_dir("cuda"), "moe.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    for dtype in args.dtypes.split(","):
        if dtype not in ("bf16", "fp8"):
            raise SystemExit(f"--dtypes: unknown {dtype!r} (bf16, fp8)")
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for m, dtype in ((int(t), d) for d in args.dtypes.split(",")
                         for t in args.tokens.split(",")):
            row = _row(model, m, bandwidth, vllm, args.iters, dtype)
            torch.cuda.empty_cache()  # the previous shape's weights
            rows.append(row)
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
            with open(out, "w") as f:  # after every row: a run cut short keeps what it measured
                json.dump(dict(device=common.device_name("cuda"), torch=torch.__version__,
                               copy_bandwidth_GBps=bandwidth / 1e9, rows=rows), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
