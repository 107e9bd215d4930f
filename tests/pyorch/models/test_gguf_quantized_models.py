"""Tiny quantized GGUF models through the engine against their dequantized float reference.

Each file holds random blocks of the types a real GGUF mixes: Q4_K_M- and Q5_K_M-style files
(Q4_K or Q5_K, with Q6_K for ffn_down, attn_v and the output matrix), Q3_K_M- and Q2_K-style
ones (Q3_K / Q2_K, with more bits where llama.cpp keeps them) and legacy ones (Q4_0 / Q4_1 / Q8_0;
Q5_0 / Q5_1). On the
CPU every such tensor is repacked at load and the decoder layers run `forward_fused`
(ggml_mul_mat_repacked_fused); the reference is transformers' model holding the same blocks
dequantized by the gguf package, its linear layers rounding their input to 8 bits per 32 values
as the product kernels do. Greedy tokens must agree up to the reference's first near-tie.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pyorch import LLM, SamplingParams, _ops
from pyorch.layers import fused_linear
from tests.reference import gguf as ref

transformers = pytest.importorskip("transformers")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 256, 4, 2, 64, 512, 96, 2
MIXES = {
    "q4_k_m": {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K,
               "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K,
               "token_embd": Q.Q4_K},
    "q4_k": {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q4_K, "attn_output": Q.Q4_K,
             "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q4_K, "output": Q.Q6_K,
             "token_embd": Q.Q4_K},
    "q5_k_m": {"attn_q": Q.Q5_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K,
               "ffn_gate": Q.Q5_K, "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K,
               "token_embd": Q.Q5_K},
    "q2_k": {"attn_q": Q.Q2_K, "attn_k": Q.Q2_K, "attn_v": Q.Q3_K, "attn_output": Q.Q3_K,
             "ffn_gate": Q.Q2_K, "ffn_up": Q.Q2_K, "ffn_down": Q.Q3_K, "output": Q.Q6_K,
             "token_embd": Q.Q2_K},
    "q3_k_m": {"attn_q": Q.Q3_K, "attn_k": Q.Q3_K, "attn_v": Q.Q5_K, "attn_output": Q.Q4_K,
               "ffn_gate": Q.Q3_K, "ffn_up": Q.Q3_K, "ffn_down": Q.Q5_K, "output": Q.Q6_K,
               "token_embd": Q.Q3_K},
    "q5": {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q5_1, "attn_output": Q.Q5_0,
           "ffn_gate": Q.Q5_1, "ffn_up": Q.Q5_1, "ffn_down": Q.Q5_0, "output": Q.Q5_1,
           "token_embd": Q.Q5_0},
    "legacy": {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1,
               "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0, "output": Q.Q8_0,
               "token_embd": Q.Q8_0},
}


def _write(path: Path, arch: str, mix: dict, tied: bool, rng: np.random.Generator) -> str:
    writer = ref.llama_family_writer(path, arch, layers=LAYERS, hidden=HIDDEN, inter=INTER,
                                     heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                     rope_base=10000.0)

    def matrix(name: str, kind: str, rows: int, cols: int) -> None:
        qtype = mix[kind]
        writer.add_tensor(name, ref.make_weight(qtype, rows, cols, rng), raw_dtype=qtype)

    def vector(name: str, n: int, mean: float = 1.0) -> None:
        writer.add_tensor(name, (mean + 0.1 * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", "token_embd", VOCAB, HIDDEN)
    vector("output_norm.weight", HIDDEN)
    if not tied:
        matrix("output.weight", "output", VOCAB, HIDDEN)
    q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", HIDDEN)
        vector(b + "ffn_norm.weight", HIDDEN)
        matrix(b + "attn_q.weight", "attn_q", q_rows, HIDDEN)
        matrix(b + "attn_k.weight", "attn_k", kv_rows, HIDDEN)
        matrix(b + "attn_v.weight", "attn_v", kv_rows, HIDDEN)
        matrix(b + "attn_output.weight", "attn_output", HIDDEN, q_rows)
        matrix(b + "ffn_gate.weight", "ffn_gate", INTER, HIDDEN)
        matrix(b + "ffn_up.weight", "ffn_up", INTER, HIDDEN)
        matrix(b + "ffn_down.weight", "ffn_down", HIDDEN, INTER)
        if arch == "qwen2":
            for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                vector(b + part + ".bias", rows, mean=0.0)
        if arch == "qwen3":
            vector(b + "attn_q_norm.weight", HEAD_DIM)
            vector(b + "attn_k_norm.weight", HEAD_DIM)
    ref.finish_gguf(writer)
    return str(path)


def _reference(path: str):  # type: ignore[no-untyped-def]
    from pyorch.model_loader import load_hf_config
    from tests.reference.gguf import dequantized_weights

    config = load_hf_config(path)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    missing, unexpected = model.load_state_dict(dict(dequantized_weights(path)), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    if missing:
        model.tie_weights()

    def a8(module, args):  # the product kernels' 8-bit activation
        x = args[0]
        return (ref.quantize_activation(x.reshape(-1, x.shape[-1])).to(x.dtype).view(x.shape),)

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(a8)
    return model.float().eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_quantized_gguf_greedy_matches_the_dequantized_reference(
    tmp_path: Path, monkeypatch, arch: str, mix: str
) -> None:
    rng = np.random.default_rng(sorted(MIXES).index(mix) * 10 + len(arch))
    path = _write(tmp_path / f"{arch}-{mix}.gguf", arch, MIXES[mix], arch == "qwen3", rng)
    calls = []
    real = _ops.ggml_mul_mat_repacked_fused
    monkeypatch.setattr(_ops, "ggml_mul_mat_repacked_fused",
                        lambda *a: (calls.append(1), real(*a))[1])
    # One-shard layers call the op overload directly (fused_linear._gguf_one_shard).
    real_overload = fused_linear._GGUF_FUSED
    monkeypatch.setattr(fused_linear, "_GGUF_FUSED",
                        lambda *a: (calls.append(1), real_overload(*a))[1])
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=128,
              seed=0, kv_cache_memory_bytes=16 << 20)
    hf = _reference(path)
    prompts = [[1, 5, 9, 13, 2], [7, 3, 3, 40, 21, 8, 11, 60, 90, 4]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert calls  # the repacked layers ran fused
    for prompt, out in zip(prompts, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        ids = list(prompt)
        with torch.no_grad():
            for k, token in enumerate(got):
                row = hf(torch.tensor([ids])).logits[0, -1]
                want = int(row.argmax())
                if token != want:  # only at a near-tie may the two part
                    margin = float(row[want] - row[token])
                    assert margin <= 5e-3 * float(row.max() - row.min()), (prompt, k, margin)
                    break
                ids.append(token)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_q4k_gguf_on_cuda_runs_the_fused_decode_layer(tmp_path: Path, monkeypatch,
                                                      arch: str) -> None:
    # Q4_K in every linear layer: on CUDA (with PYORCH_GGUF_FUSED_DECODE=1) a one-token step
    # runs the decoder layers' forward_fused through ggml_mul_mat_vec_fused (the norm and
    # SiLU-and-mul formed inside the direct Q4_K kernel, the residual adds in its store).
    # bfloat16 greedy tokens against the unfused layers' (fused_linear.FUSED_DECODE off): equal
    # up to the first near-tie there.
    import gc

    from pyorch.layers import fused_linear

    monkeypatch.setenv("PYORCH_GGUF_FUSED_DECODE", "1")
    rng = np.random.default_rng(41 + len(arch))
    path = _write(tmp_path / f"{arch}-q4k.gguf", arch, MIXES["q4_k"], arch == "qwen3", rng)
    calls: list[str] = []
    real = _ops.ggml_mul_mat_vec_fused
    monkeypatch.setattr(_ops, "ggml_mul_mat_vec_fused",
                        lambda *a: (calls.append(a[-2]), real(*a))[1])
    prompts = [[1, 5, 9, 13, 2], [7, 3, 3, 40, 21, 8, 11, 60, 90, 4]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)

    def run() -> list:
        llm = LLM(path, skip_tokenizer_init=True, dtype=torch.bfloat16, max_model_len=128,
                  seed=0, kv_cache_memory_bytes=64 << 20)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return [o.outputs[0] for o in outs]

    fused = run()
    assert set(calls) == {"rms_norm", "none", "silu_and_mul"}, set(calls)
    calls.clear()
    monkeypatch.setattr(fused_linear, "FUSED_DECODE", False)
    unfused = run()
    assert not calls
    for f, u in zip(fused, unfused, strict=True):
        for k, (a, b) in enumerate(zip(f.token_ids, u.token_ids, strict=True)):
            if a != b:  # only where the unfused layer's top two nearly tie
                top = u.logprobs[k]
                assert a in top and b in top, (k, a, b, top)
                assert abs(top[a].logprob - top[b].logprob) <= 0.05, (k, top)
                break
