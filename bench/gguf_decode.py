"""Batch-1 decode of a Llama-3-8B-shaped GGUF file (random blocks) through pyorch, against the
weight-read floor measured in the same run: issue 21's "GGUF Q4_K / Q8_0 8B-shape batch-1 decode
>= 70% of the weight-read bandwidth floor", end to end rather than per GEMM.

    PYTHONPATH=$PWD python bench/gguf_decode.py --types Q4_K,Q8_0 \
        --config .models/llama3-8b-dummy/config.json --json OUT.json

Per type, writes DIR/llama-8b-TYPE.gguf (reused when present; --dir, default /tmp/gguf_decode):
every projection of that type, the output (LM head) of --output-type (default: Q6_K for the
K-quants, as llama.cpp's Q*_K files have it, else the same type) and the token embedding of the
projections' type. Blocks are random bytes with modest fp16 scales (speed does not depend on the
values). Decode time per token = (time of a 1 + N token generation - time of a 1 token
generation) / N, greedy, ignore_eos, 32-token prompt, median of --repeats.

--fused-decode on,off times each file with the decoder layers' fused decode path where the
engine takes it (pyorch/layers/fused_linear.py; on CUDA, Q4_K layers go through
ggml_mul_mat_vec_fused with PYORCH_GGUF_FUSED_DECODE=1) and with every layer unfused, one after
the other (default: on, the engine's own choice).

The floor: the bytes one decode step must read (every projection, the LM head, the K/V cache at
the mean context) over a device-to-device copy's bandwidth in the same process (read + write
bytes / time, as bench_gguf counts it). pct_of_floor = floor / measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from pyorch.layers import fused_linear

LLAMA3_8B = {  # used when --config is missing (the dummy config's values)
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 8192,
}
# Byte offsets of each block's fp16 scale fields (d, and dmin / m where the type has one).
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
PROMPT_LEN = 32


def _qtype(name: str):  # type: ignore[no-untyped-def]
    from gguf import GGMLQuantizationType

    if name not in FP16_FIELDS:
        raise SystemExit(f"unsupported type {name!r}: one of {', '.join(FP16_FIELDS)}")
    return GGMLQuantizationType[name]


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] uint8 of `type_name`: random bytes, fp16 scales in [0.001, 0.01)."""
    from gguf import GGML_QUANT_SIZES

    block_size, block_bytes = GGML_QUANT_SIZES[_qtype(type_name)]
    if cols % block_size:
        raise SystemExit(f"{cols} columns are not whole {type_name} blocks of {block_size}")
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        scale = rng.uniform(0.001, 0.01, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def shapes(cfg: dict[str, Any]) -> dict[str, int]:
    h, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    return {"hidden": h, "inter": cfg["intermediate_size"], "layers": cfg["num_hidden_layers"],
            "heads": heads, "kv_heads": kv_heads, "head_dim": hd, "vocab": cfg["vocab_size"]}


def default_output_type(type_name: str) -> str:
    return "Q6_K" if type_name.endswith("_K") else type_name


def write_gguf(path: str, cfg: dict[str, Any], type_name: str, output_type: str,
               seed: int = 0) -> dict[str, int]:
    """Writes the file (unless present) and returns the bytes a decode step reads from it:
    {"projections": ..., "lm_head": ...}."""
    from gguf import GGML_QUANT_SIZES, GGUFWriter

    s = shapes(cfg)
    h, inter, hd = s["hidden"], s["inter"], s["head_dim"]
    q_rows, kv_rows = s["heads"] * hd, s["kv_heads"] * hd
    layer = [("attn_q", q_rows, h), ("attn_k", kv_rows, h), ("attn_v", kv_rows, h),
             ("attn_output", h, q_rows), ("ffn_gate", inter, h), ("ffn_up", inter, h),
             ("ffn_down", h, inter)]
    rng = np.random.default_rng(seed)
    sizes = {"projections": 0, "lm_head": 0}
    writer = None if os.path.exists(path) else GGUFWriter(path + ".part", "llama")

    def matrix(name: str, type_: str, rows: int, cols: int) -> int:
        """Adds the tensor (when writing); its bytes."""
        if writer:
            writer.add_tensor(name, random_blocks(type_, rows, cols, rng), raw_dtype=_qtype(type_))
        block_size, block_bytes = GGML_QUANT_SIZES[_qtype(type_)]
        return rows * cols // block_size * block_bytes

    if writer:
        writer.add_block_count(s["layers"])
        writer.add_context_length(int(cfg.get("max_position_embeddings", 8192)))
        writer.add_embedding_length(h)
        writer.add_feed_forward_length(inter)
        writer.add_head_count(s["heads"])
        writer.add_head_count_kv(s["kv_heads"])
        writer.add_key_length(hd)
        writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
        writer.add_rope_freq_base(float(cfg.get("rope_theta", 500000.0)))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    matrix("token_embd.weight", type_name, s["vocab"], h)
    sizes["lm_head"] = matrix("output.weight", output_type, s["vocab"], h)
    if writer:
        writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(s["layers"]):
        if writer:
            writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, dtype=np.float32))
            writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, dtype=np.float32))
        for part, rows, cols in layer:
            sizes["projections"] += matrix(f"blk.{i}.{part}.weight", type_name, rows, cols)
    if writer:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(path + ".part", path)
    return sizes


def copy_gbs(device: str) -> float:
    """Device-to-device copy bandwidth, (read + write) bytes per second / 1e9."""
    if device == "cuda":
        from pyorch.benchmarks.attention import copy_bandwidth

        return copy_bandwidth() / 1e9
    src = torch.empty(1 << 28, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 2 * src.numel() * 5 / (time.perf_counter() - t) / 1e9


def time_decode(path: str, device: str, new_tokens: int, repeats: int) -> dict[str, Any]:
    from pyorch import LLM
    from pyorch.benchmarks.common import decode_ms_per_token

    t0 = time.time()
    if device == "cuda":
        # A fixed KV budget (the contexts here are short): with a fraction of the memory, the
        # second type's engine counted the first's, not yet returned to the device, as weights
        # (H200: "weights take 75.50 GiB" for an 8.5 GB Q8_0 file, and no KV cache).
        llm = LLM(path, skip_tokenizer_init=True, dtype=torch.bfloat16, max_model_len=1024,
                  kv_cache_memory_bytes=1 << 30, seed=0, max_num_seqs=4)
    else:
        llm = LLM(path, skip_tokenizer_init=True, dtype="float32", device="cpu",
                  max_model_len=256, seed=0, max_num_seqs=4, kv_cache_memory_bytes=64 << 20)
    load_s = time.time() - t0
    ms = decode_ms_per_token(llm, new_tokens, repeats, range(10, 10 + PROMPT_LEN))
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"load_s": round(load_s, 1), "ms_per_token": statistics.median(ms), "samples_ms": ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default="Q4_K,Q8_0", help="comma-separated GGML types")
    p.add_argument("--output-type", default="",
                   help="the LM head's type (default: Q6_K for K-quants, else the type)")
    p.add_argument("--config", default=".models/llama3-8b-dummy/config.json",
                   help="a transformers config.json for the shapes (Llama-3-8B if missing)")
    p.add_argument("--dir", default="/tmp/gguf_decode")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cuda", "cpu"))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--fused-decode", default="on",
                   help="comma-separated on / off: time with the fused decode layers, without, or "
                        "both (on,off), one after the other")
    args = p.parse_args()
    fused_modes = [m.strip() for m in args.fused_decode.split(",") if m.strip()]
    if not fused_modes or any(m not in ("on", "off") for m in fused_modes):
        raise SystemExit(f"--fused-decode takes on / off values, got {args.fused_decode!r}")
    if args.new_tokens < 1 or args.repeats < 1:
        raise SystemExit("--new-tokens and --repeats must be at least 1")
    cfg = dict(LLAMA3_8B)
    if os.path.exists(args.config):
        with open(args.config) as f:
            cfg = json.load(f)
    s = shapes(cfg)
    os.makedirs(args.dir, exist_ok=True)
    gbs = copy_gbs(args.device)
    print(f"copy {gbs:.1f} GB/s on {args.device}", flush=True)
    rows = []
    for type_name in [t.strip() for t in args.types.split(",") if t.strip()]:
        _qtype(type_name)
        output_type = args.output_type or default_output_type(type_name)
        _qtype(output_type)
        path = os.path.join(args.dir, f"llama-{s['layers']}l-{type_name}-{output_type}.gguf")
        t0 = time.time()
        sizes = write_gguf(path, cfg, type_name, output_type)
        print(f"{path} ready in {time.time() - t0:.1f} s", flush=True)
        for mode in fused_modes:
            fused_linear.FUSED_DECODE = mode == "on"
            result = time_decode(path, args.device, args.new_tokens, args.repeats)
            row = _row(type_name, output_type, sizes, s, gbs, result, args.device,
                       args.new_tokens)
            row["fused_decode"] = mode == "on"
            print(f"{type_name} (head {output_type}, fused decode {mode}): "
                  f"{row['ms_per_token']:.3f} ms/token, floor {row['floor_ms']:.3f} ms "
                  f"({row['step_bytes'] / 1e9:.2f} GB at {gbs:.0f} GB/s): "
                  f"{row['pct_of_floor']:.1f}% of the floor", flush=True)
            rows.append(row)
    if args.json:
        device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "config": s, "new_tokens": args.new_tokens,
                       "rows": rows}, f, indent=1)


def _row(type_name: str, output_type: str, sizes: dict[str, int], s: dict[str, int],
         gbs: float, result: dict[str, Any], device: str, new_tokens: int) -> dict[str, Any]:
    """One timed file's JSON row: its bytes, the floor and the measured time."""
    # K and V of every layer at the mean context of the timed tokens, 2-byte elements (4 on the
    # CPU, where the cache is fp32).
    elem = 2 if device == "cuda" else 4
    mean_ctx = PROMPT_LEN + (new_tokens + 1) / 2
    kv_bytes = int(2 * s["layers"] * s["kv_heads"] * s["head_dim"] * elem * mean_ctx)
    step_bytes = sizes["projections"] + sizes["lm_head"] + kv_bytes
    floor_ms = step_bytes / (gbs * 1e9) * 1e3
    return {"type": type_name, "output_type": output_type, **sizes, "kv_bytes": kv_bytes,
            "step_bytes": step_bytes, "copy_gbs": round(gbs, 1), "floor_ms": floor_ms,
            **result, "pct_of_floor": 100 * floor_ms / result["ms_per_token"]}

if __name__ == "__main__":
    main()
