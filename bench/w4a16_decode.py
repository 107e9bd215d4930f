"""Batch-1 decode of a Llama-3-8B-shaped GPTQ checkpoint (4-bit, group 128, random codes) on one
GPU: pyorch (and vLLM on the same checkpoint with --vllm, when importable).

    PYTHONPATH=/tmp/site:$PWD python bench/w4a16_decode.py \
        --config .models/llama3-8b-dummy/config.json --json OUT.json [--vllm]

Writes the checkpoint to --dir (default /tmp/w4a16_llama3_8b_gptq; reused when present): the
"gptq" v1 format AutoGPTQ writes (qweight / qzeros / scales / g_idx per projection, bf16
embeddings, norms and lm_head). Decode time per token = (time of a 1 + N token generation -
time of a 1 token generation) / N, greedy, ignore_eos, median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from safetensors.torch import save_file

LLAMA3_8B = {  # used when --config is missing (the dummy config's values)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
}
GROUP = 128


def _gptq_layer(k: int, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda",
                            generator=gen)
    return {
        "qweight": qweight.cpu(),
        "qzeros": torch.full((k // GROUP, n // 8), 0x77777777, dtype=torch.int32),  # z = 8
        "scales": (torch.rand(k // GROUP, n, device="cuda", generator=gen) * 2e-3 + 1e-3)
        .half().cpu(),
        "g_idx": (torch.arange(k, dtype=torch.int32) // GROUP),
    }


def write_checkpoint(path: str, cfg: dict[str, Any]) -> None:
    if os.path.exists(os.path.join(path, "done")):
        return
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    vocab = cfg["vocab_size"]
    base = {
        "model.embed_tokens.weight": torch.randn(vocab, h, device="cuda", generator=gen) * 0.02,
        "lm_head.weight": torch.randn(vocab, h, device="cuda", generator=gen) * 0.02,
        "model.norm.weight": torch.ones(h, device="cuda"),
    }
    save_file({k: v.bfloat16().cpu() for k, v in base.items()},
              os.path.join(path, "model-base.safetensors"))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors = {f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
        for name, k, n in (("self_attn.q_proj", h, q), ("self_attn.k_proj", h, kv),
                           ("self_attn.v_proj", h, kv), ("self_attn.o_proj", q, h),
                           ("mlp.gate_proj", h, inter), ("mlp.up_proj", h, inter),
                           ("mlp.down_proj", inter, h)):
            for key, value in _gptq_layer(k, n, gen).items():
                tensors[f"{p}.{name}.{key}"] = value
        save_file(tensors, os.path.join(path, f"model-{i:03d}.safetensors"))
    cfg = dict(cfg, quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    open(os.path.join(path, "done"), "w").close()


def time_pyorch(path: str, new_tokens: int, repeats: int) -> dict[str, Any]:
    from pyorch import LLM
    from pyorch.benchmarks.common import decode_ms_per_token

    t0 = time.time()
    llm = LLM(path, skip_tokenizer_init=True, dtype=torch.bfloat16, max_model_len=1024,
              gpu_memory_utilization=0.5, seed=0, max_num_seqs=4)
    load_s = time.time() - t0
    ms = decode_ms_per_token(llm, new_tokens, repeats, range(10, 42))
    return {"engine": "pyorch", "load_s": load_s, "ms_per_token": statistics.median(ms),
            "samples_ms": ms}


VLLM_SNIPPET = """
import json, statistics, sys, time
from vllm import LLM, SamplingParams
path, n, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
          gpu_memory_utilization=0.4, seed=0, max_num_seqs=4)
prompt = [{"prompt_token_ids": list(range(10, 42))}]
def run(k):
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    return time.perf_counter() - t
run(n + 1)
ms = [(run(n + 1) - run(1)) * 1e3 / n for _ in range(repeats)]
print("VLLM_DECODE " + json.dumps({"engine": "vllm", "ms_per_token": statistics.median(ms),
                                    "samples_ms": ms}), flush=True)
"""


def time_vllm(path: str, new_tokens: int, repeats: int, timeout: int) -> dict[str, Any]:
    # The staged vLLM bundle (shared/tools/vllm-peer) has no flashinfer: its sampler is turned
    # off as the bundle's README does (greedy decode samples by argmax either way).
    env = dict(os.environ)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    try:
        out = subprocess.run([sys.executable, "-c", VLLM_SNIPPET, path, str(new_tokens),
                              str(repeats)], capture_output=True, text=True, timeout=timeout,
                             env=env)
    except subprocess.TimeoutExpired:
        return {"engine": "vllm", "error": f"timed out after {timeout} s"}
    for line in out.stdout.splitlines():
        if line.startswith("VLLM_DECODE "):
            return dict(json.loads(line[len("VLLM_DECODE "):]))
    return {"engine": "vllm", "error": (out.stderr or out.stdout)[-2000:]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=".models/llama3-8b-dummy/config.json")
    p.add_argument("--dir", default="/tmp/w4a16_llama3_8b_gptq")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vllm", action="store_true")
    p.add_argument("--vllm-timeout", type=int, default=150)
    p.add_argument("--scales-by-copy", type=int, choices=(0, 1), default=None,
                   help="the W4A16 stream kernel's groups of 128 take their scales by bulk "
                        "copies (1) or global loads (0); default: the library's default. Set "
                        "before the engine captures its CUDA graphs")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.scales_by_copy is not None:
        from pyorch import _C
        _C.set_w4a16_stream_scales_by_copy(bool(args.scales_by_copy))
    cfg = dict(LLAMA3_8B)
    if os.path.exists(args.config):
        with open(args.config) as f:
            cfg = json.load(f)
    t0 = time.time()
    write_checkpoint(args.dir, cfg)
    print(f"checkpoint ready in {time.time() - t0:.1f} s: {args.dir}", flush=True)
    rows = [time_pyorch(args.dir, args.new_tokens, args.repeats)]
    if args.scales_by_copy is not None:
        rows[-1]["scales_by_copy"] = args.scales_by_copy
    print(json.dumps(rows[-1]), flush=True)
    if args.vllm:
        torch.cuda.empty_cache()
        rows.append(time_vllm(args.dir, args.new_tokens, args.repeats, args.vllm_timeout))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
