"""`pyorch bench latency`: decode latency of one batch (batch 1 by default), in ms per output
token, against floors measured in the same run.

Measured: `--num-iters` runs (after `--num-iters-warmup`) of one batch of `--batch-size` random
prompts of `--input-len` tokens generating `--output-len` tokens (ignore_eos), and as many runs
generating one token (prefill only). Reported, from the medians:

* request latency and ms per output token (request latency / output_len, prefill included);
* decode ms per token = (full - prefill-only) / (output_len - 1).

Floors:

* (a) weight-read floor = bytes of the weights a decode step reads (every parameter except an
  untied input embedding, which is gathered, not read; of a mixture-of-experts layer only the
  experts the batch routes to: top_k of them at batch 1, the expected number of distinct experts
  under uniform routing above) / copy bandwidth. The copy bandwidth is a
  `dst.copy_(src)` of a large buffer on the device, counted as bytes read + written (2 x buffer
  size / time), the convention of docs/performance.md.
* (b) the model's own GEMM chain: every linear layer and the LM head with their real weights
  (pyorch's fused shapes) at M = batch size, `torch.matmul` (cuBLAS on CUDA). On CUDA it is
  captured in one CUDA graph and replayed, timed by events; the eager chain is timed everywhere.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, cast

import torch

from pyorch.benchmarks import common

NAME = "latency"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-iters-warmup", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--copy-bytes", type=int, default=None,
                        help="buffer size of the copy-bandwidth probe (default 1 GiB on CUDA, "
                             "256 MiB on CPU)")
    parser.add_argument("--output-json", default=None,
                        help="result file (default bench/results/<device>/latency.json)")
    common.add_engine_args(parser)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, num_bytes: int, iters: int = 10) -> dict[str, Any]:
    """Device-to-device copy of `num_bytes`; bandwidth counts bytes read + written."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    seconds = common.median(times)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return {"buffer_bytes": num_bytes, "median_s": seconds, "bytes_per_s": moved / seconds,
            "convention": "bytes read + written (2 x buffer) / time"}


def active_expert_fraction(num_experts: int, top_k: int, batch: int) -> float:
    """The expected fraction of a layer's experts that a batch of `batch` tokens routes to, with
    each token's top_k distinct experts drawn uniformly: 1 - (1 - top_k / E)^batch (exactly
    top_k / E at batch 1)."""
    return 1.0 - (1.0 - top_k / num_experts) ** batch


def decode_weights(model: torch.nn.Module, batch: int = 1) -> tuple[int, list[torch.Tensor]]:
    """(bytes a decode step of `batch` tokens reads, the 2-D weights of the GEMM chain in forward
    order).

    Every unique parameter counts, except an input embedding whose weight no LM head shares
    (a step gathers `batch` rows of it); a FusedMoE layer's experts count for the share the
    batch routes to (active_expert_fraction). The chain is every linear layer plus the LM
    head."""
    from pyorch.layers.fused_moe import FusedMoE
    from pyorch.layers.linear import LinearBase
    from pyorch.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    head_ptrs = {m.weight.data_ptr() for m in heads}
    skip = {m.weight.data_ptr() for m in model.modules()
            if type(m) is VocabParallelEmbedding and m.weight.data_ptr() not in head_ptrs}
    seen: set[int] = set()
    read_bytes = 0.0
    for moe in (m for m in model.modules() if isinstance(m, FusedMoE)):
        share = active_expert_fraction(moe.global_num_experts, moe.top_k, batch)
        for p in (moe.w13_weight, moe.w2_weight):
            seen.add(p.data_ptr())
            read_bytes += p.numel() * p.element_size() * share
    for p in model.parameters():  # buffers (rotary cos/sin tables) are gathered by position
        if p.data_ptr() in seen or p.data_ptr() in skip:
            continue
        seen.add(p.data_ptr())
        read_bytes += p.numel() * p.element_size()
    # A LinearBase's weight is registered by its quant method (create_weights): nn.Module's
    # stubs type it as Tensor | Module.
    chain = [cast(torch.Tensor, m.weight) for m in model.modules() if isinstance(m, LinearBase)]
    chain += [m.weight for m in heads]
    return round(read_bytes), [w for w in chain if w.dim() == 2]


@torch.inference_mode()
def gemm_chain(weights: list[torch.Tensor], batch: int, device: torch.device,
               iters: int = 20) -> dict[str, Any]:
    """Times x[M, K] @ W.T[K, N] for every weight in order: eager always, CUDA graph on CUDA."""
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype, device=device)
              for w in weights}
    outs = [torch.empty(batch, w.shape[0], dtype=w.dtype, device=device) for w in weights]

    def run() -> None:
        for w, out in zip(weights, outs, strict=True):
            torch.matmul(inputs[w.shape[1]], w.t(), out=out)

    flops = sum(2 * batch * w.shape[0] * w.shape[1] for w in weights)
    result: dict[str, Any] = {"num_gemms": len(weights), "flops": flops,
                              "weight_bytes": sum(w.numel() * w.element_size() for w in weights)}
    run()
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    result["eager_ms"] = common.median(times) * 1e3
    if device.type == "cuda":
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            run()  # cuBLAS picks its workspace outside the capture
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        start_ev = torch.cuda.Event(enable_timing=True)
        end_ev = torch.cuda.Event(enable_timing=True)
        graph_times = []
        for _ in range(iters):
            start_ev.record()
            graph.replay()
            end_ev.record()
            end_ev.synchronize()
            graph_times.append(start_ev.elapsed_time(end_ev))
        result["cuda_graph_ms"] = common.median(graph_times)
        del graph
    return result


def _time_generate(llm: Any, prompts: list[list[int]], max_tokens: int, iters: int) -> list[float]:
    from pyorch import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    times = []
    for _ in range(iters):
        llm.reset_prefix_cache()  # every run prefills its prompts from scratch
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        got = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        if got != max_tokens * len(prompts):
            raise RuntimeError(f"generated {got} tokens, expected {max_tokens * len(prompts)}")
    return times


def main(args: argparse.Namespace) -> int:
    from pyorch import LLM
    from pyorch.model_loader import load_hf_config

    if args.output_len < 2:
        raise SystemExit("--output-len must be >= 2 (decode = full run - prefill-only run)")
    device_name = common.resolve_device(args.device)
    model_path = common.resolve_model(args.model)
    env = common.environment(device_name)
    seed = args.seed or 0
    vocab = int(load_hf_config(model_path).vocab_size)
    prompts = common.random_token_prompts([args.input_len] * args.batch_size, vocab, seed)

    # Before the engine takes its share of device memory (gpu_memory_utilization).
    copy_device = torch.device(device_name)
    copy = copy_bandwidth(copy_device, args.copy_bytes or (2**30 if copy_device.type == "cuda"
                                                           else 2**28))
    # The engine's own max_num_seqs unless given, as vLLM's `bench latency` leaves it: pinned to
    # the batch size (as it was), mixed-batch CUDA graphs stopped at 2 x batch tokens, so a
    # batch-1 prompt of more than 2 tokens prefilled eagerly (H200, Llama-3-8B fp8, 128 tokens:
    # 4.06 ms of host launches against 4.18 ms of kernels in an 8.73 ms step).
    llm = LLM(model_path, **common.engine_kwargs(args, device=device_name))
    _time_generate(llm, prompts, args.output_len, args.num_iters_warmup)
    core = llm.llm_engine.engine_core
    before = core.timings.snapshot()
    full = _time_generate(llm, prompts, args.output_len, args.num_iters)
    phases = core.timings.per_step_ms(before)  # host phases per step (+ the wait on the device)
    num_steps = max(phases["steps"], 1)
    host_ms_per_step = phases["host"]
    prefill = _time_generate(llm, prompts, 1, args.num_iters)
    full_s, prefill_s = common.median(full), common.median(prefill)
    decode_ms = (full_s - prefill_s) / (args.output_len - 1) * 1e3

    summary = {
        "request_latency_s_median": full_s,
        "request_latency_s_p90": common.percentile(full, 90),
        "prefill_only_latency_s_median": prefill_s,
        "ms_per_output_token": full_s / args.output_len * 1e3,
        "decode_ms_per_token": decode_ms,
        "dtype": str(llm.llm_engine.config.model_config.dtype),
        "tensor_parallel_size": llm.llm_engine.config.parallel_config.tensor_parallel_size,
        "engine_steps_per_request": num_steps / args.num_iters,
        "host_ms_per_step": host_ms_per_step,
        "step_phases_ms": phases,
        "async_scheduling": core.async_scheduling,
    }
    print(f"batch {args.batch_size}, in {args.input_len}, out {args.output_len}: request "
          f"{full_s * 1e3:.1f} ms (median of {args.num_iters}), "
          f"{summary['ms_per_output_token']:.2f} "
          f"ms per output token, decode {decode_ms:.2f} ms/token")
    print(f"CPU time per engine step: {host_ms_per_step:.2f} ms over "
          f"{num_steps / args.num_iters:.0f} steps per request (async scheduling "
          f"{'on' if core.async_scheduling else 'off'}): {common.format_phases(phases)}")
    # The floors need the model in this process: not with tensor-parallel workers.
    runner = getattr(core.model_executor, "model_runner", None)
    if runner is None:
        print("weight-read floor and GEMM chain: skipped (the model runs in worker processes)")
    else:
        model = runner.model
        device = next(model.parameters()).device
        read_bytes, weights = decode_weights(model, args.batch_size)
        floor_ms = read_bytes / copy["bytes_per_s"] * 1e3
        summary.update({
            "weight_read_bytes": read_bytes,
            "copy_bandwidth": copy,
            "weight_read_floor_ms": floor_ms,
            "decode_over_weight_read_floor": decode_ms / floor_ms,
        })
        print(f"weight-read floor: {read_bytes / 1e9:.3f} GB / {copy['bytes_per_s'] / 1e9:.1f} "
              f"GB/s (copy, read+written) = {floor_ms:.3f} ms -> decode is "
              f"{decode_ms / floor_ms:.2f}x")
        # The chain is torch.matmul on the model's own weights: float weights only (a quantized
        # model's packed or fp8 weights have no plain matmul to compare with).
        if all(w.dtype.is_floating_point and w.element_size() >= 2 for w in weights):
            chain = gemm_chain(weights, args.batch_size, device)
            chain_ms = chain.get("cuda_graph_ms", chain["eager_ms"])
            summary.update({"gemm_chain": chain, "decode_over_gemm_chain": decode_ms / chain_ms})
            graph = (f", CUDA graph {chain['cuda_graph_ms']:.3f} ms"
                     if "cuda_graph_ms" in chain else "")
            print(f"GEMM chain ({chain['num_gemms']} matmuls at M={args.batch_size}): eager "
                  f"{chain['eager_ms']:.3f} ms{graph} -> decode is {decode_ms / chain_ms:.2f}x")
        else:
            print("GEMM chain: skipped (quantized weights)")
    rows = [{"kind": "full", "latency_s": t} for t in full]
    rows += [{"kind": "prefill_only", "latency_s": t} for t in prefill]
    json_path, _ = common.output_paths(NAME, device_name, args.output_json)
    common.write_json(json_path, {"benchmark": NAME, "model": model_path,
                                  "args": common.args_dict(args), "env": env, "rows": rows,
                                  "summary": summary})
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cli_args(parser)
    raise SystemExit(main(parser.parse_args()))
