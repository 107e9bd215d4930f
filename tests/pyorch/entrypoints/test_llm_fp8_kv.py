"""The engine with an fp8 KV cache (kv_cache_dtype="fp8" / "fp8_e4m3") on tiny random Llama and
Qwen3 checkpoints.

The reference is transformers' model in float32 with one change, in pure PyTorch: the attention
sees every key and value after the fp8 round trip the cache makes (x / scale to e4m3, back to
float times scale), with the layer's scales. On the CPU (float32) the engine's greedy tokens must
equal that reference's token for token. Against the model without fp8 ("auto"), the fp8 engine's
tokens are scored teacher-forced: the share of steps whose token is the auto model's argmax given
the same prefix (so one early flip does not count against every later token), and those shares
must reach MIN_ARGMAX_AGREEMENT / MIN_NEAR_AGREEMENT. On CUDA (bf16, CUDA graphs on) the same
tests run, against the reference with the bf16 teacher-forced margin of test_llm.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from pyorch import LLM, SamplingParams
from pyorch.layers.attention import Attention
from tests.conftest import CUDA_AVAILABLE
from tests.pyorch.entrypoints.test_llm import (
    DTYPE,
    _assert_pool_empty,
    _make_llm,
    _prompts,
    _tiny_config,
)

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 16
# Teacher-forced agreement of fp8 with auto (see the module docstring): the share of fp8 tokens
# that are auto's argmax, and that are within 2% of the logit range of it. Measured on the CPU
# (float32): argmax 0.945 (Llama) and 0.898 (Qwen3), within 2% 1.0 for both; random tiny models
# have many near-ties. A wrong scale or a dropped key falls far below.
# On an H100 (bf16, CUDA graphs, against the float32 model): argmax 0.883 (Llama) and 0.852
# (Qwen3), within 2% 0.977 and 0.984.
MIN_ARGMAX_AGREEMENT = 0.85 if DTYPE == torch.float32 else 0.75
MIN_NEAR_AGREEMENT = 0.98 if DTYPE == torch.float32 else 0.95
# Per-layer (k_scale, v_scale) written into the checkpoint of the scales tests.
CKPT_SCALES = {0: (0.021, 0.034), 1: (0.0125, 0.047)}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_model(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(f"fp8kv_{arch}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_tiny_config(arch),
                                                          torch_dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


def _fp8_round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What the cache stores and gives back: e4m3(clamp(x / scale, +-448)) * scale."""
    q = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def _fp8_reference(model, scales: dict[int, tuple[float, float]]):
    """`model` with fp8-round-tripped keys and values in every attention (a copy of its
    config: the original model keeps its attention)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales.get(module.layer_idx, (1.0, 1.0))
        return sdpa_attention_forward(module, query, _fp8_round_trip(key, k_scale),
                                      _fp8_round_trip(value, v_scale), attention_mask, **kwargs)

    AttentionInterface.register("pyorch_fp8_kv_reference", attention)
    config = copy.deepcopy(model.config)
    config._attn_implementation = "pyorch_fp8_kv_reference"
    ref = type(model)(config).to(torch.float32)
    ref.load_state_dict(model.state_dict())
    assert model.config._attn_implementation != "pyorch_fp8_kv_reference"
    return ref.eval()


def _greedy_tokens(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_tokens):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def _teacher_forced_hits(model, prompt: list[int], got: list[int], margin: float) -> list[bool]:
    """Per step: is our token the model's argmax (within `margin` x the logit range) given our
    own prefix?"""
    ids = torch.tensor([prompt + got[:-1]])
    with torch.no_grad():
        logits = model.to(torch.float32)(ids).logits[0, len(prompt) - 1:].float()
    hits = []
    for row, tok in zip(logits, got, strict=False):
        hits.append(row.max().item() - row[tok].item() <= margin * (row.max() - row.min()).item())
    return hits


def _assert_matches_reference(ref, prompts, outputs) -> None:
    """CPU (float32): token for token. CUDA (bf16): teacher-forced against the fp8 reference
    (float32), whose keys were rounded to e4m3 from float32 rather than bf16 values, so a few
    codes differ by one step: >= 95% of the tokens within 2% of the logit range of its argmax,
    all within 5%."""
    near, loose = [], []
    for prompt, out in zip(prompts, outputs, strict=True):
        got = out.outputs[0].token_ids
        if DTYPE == torch.float32:
            assert got == _greedy_tokens(ref, prompt, MAX_TOKENS), f"prompt len {len(prompt)}"
        else:
            near += _teacher_forced_hits(ref, prompt, got, 0.02)
            loose += _teacher_forced_hits(ref, prompt, got, 0.05)
    if near:
        print(f"fp8 KV vs the fp8 reference over {len(near)} tokens: within 2% "
              f"{sum(near) / len(near):.3f}, within 5% {sum(loose) / len(loose):.3f}")
        assert sum(near) / len(near) >= 0.95 and all(loose)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)


def _cuda_graph_kwargs() -> dict:
    # On CUDA the fp8 cache runs through captured graphs (decode and mixed), as served.
    return dict(enforce_eager=False) if CUDA_AVAILABLE else {}


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_greedy_equals_fp8_reference(tiny_model, kv_cache_dtype):
    path, hf = tiny_model
    llm = _make_llm(path, kv_cache_dtype=kv_cache_dtype, **_cuda_graph_kwargs())
    attn = [m for m in llm.llm_engine.model_runner.attn_layers]
    assert attn and all(layer.kv_cache_dtype == kv_cache_dtype for layer in attn)
    assert all(layer.kv_cache[0].dtype == torch.uint8 for layer in attn)
    prompts = _prompts(hf.config.vocab_size)
    outputs = _generate(llm, prompts)
    _assert_matches_reference(_fp8_reference(hf, {}), prompts, outputs)
    _assert_pool_empty(llm)


def test_fp8_agrees_with_auto(tiny_model):
    """fp8 against the model without fp8, teacher-forced (printed): the share of steps whose
    token is auto's argmax, and the share within 2% of the logit range of it."""
    path, hf = tiny_model
    prompts = _prompts(hf.config.vocab_size, lens=[1, 7, 16, 17, 40, 83, 130, 250], seed=3)
    llm = _make_llm(path, kv_cache_dtype="fp8", **_cuda_graph_kwargs())
    outputs = _generate(llm, prompts)
    rates = []
    for margin in (0.0, 0.02):
        hits = [h for p, o in zip(prompts, outputs, strict=False)
                for h in _teacher_forced_hits(hf, p, o.outputs[0].token_ids, margin)]
        rates.append(sum(hits) / len(hits))
    print(f"fp8 KV vs auto, teacher-forced over {len(hits)} tokens: argmax {rates[0]:.3f}, "
          f"within 2% {rates[1]:.3f}")
    assert rates[0] >= MIN_ARGMAX_AGREEMENT and rates[1] >= MIN_NEAR_AGREEMENT


def test_fp8_doubles_the_blocks(tiny_model):
    """The same byte budget holds (model element size) x the blocks in fp8."""
    path, _ = tiny_model
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = _make_llm(path, kv_cache_dtype=kv, kv_cache_memory_bytes=16 << 20,
                        gpu_memory_utilization=0.3)
        blocks[kv] = llm.llm_engine.model_runner.cache_config.num_blocks
        del llm
    elem = torch.empty((), dtype=DTYPE).element_size()
    # 16 MiB over 2 layers x (k, v) x 16 tokens x 2 kv heads x 64 dims x bytes per element.
    assert blocks["auto"] == (16 << 20) // (2 * 2 * 16 * 2 * 64 * elem)
    assert blocks["fp8"] == elem * blocks["auto"]


def _with_kv_scales(path: str, tmp_path, style: str) -> str:
    """A copy of the checkpoint at `path` with CKPT_SCALES in one of the checkpoint styles."""
    import shutil

    out = tmp_path / f"ckpt_{style}"
    shutil.copytree(path, out)
    state = load_file(str(out / "model.safetensors"))
    for layer, (k, v) in CKPT_SCALES.items():
        attn = f"model.layers.{layer}.self_attn"
        if style == "vllm":  # the attention's own scales (vLLM, llm-compressor's fp8 KV)
            names = {f"{attn}.k_scale": k, f"{attn}.v_scale": v}
        elif style == "compressed_tensors":  # kv_cache_scheme: the k/v projections' outputs
            names = {f"{attn}.k_proj.output_scale": k, f"{attn}.v_proj.output_scale": v,
                     f"{attn}.q_proj.output_scale": 0.5}
        else:  # ModelOpt
            names = {f"{attn}.k_proj.k_scale": k, f"{attn}.v_proj.v_scale": v}
        for name, value in names.items():
            state[name] = torch.tensor([value], dtype=torch.float32)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize("style", ["vllm", "compressed_tensors", "modelopt"])
def test_checkpoint_kv_scales(tiny_model, tmp_path, style):
    """Scales in the checkpoint reach the Attention layers and the output (the reference runs
    with the same per-layer scales)."""
    path, hf = tiny_model
    ckpt = _with_kv_scales(path, tmp_path, style)
    llm = _make_llm(ckpt, kv_cache_dtype="fp8", **_cuda_graph_kwargs())
    layers = sorted((m for m in llm.llm_engine.model_runner.model.modules()
                     if isinstance(m, Attention)), key=lambda m: m.layer_idx)
    for layer in layers:
        k, v = CKPT_SCALES[layer.layer_idx]
        assert layer.k_scale.item() == pytest.approx(k) and layer.v_scale.item() == pytest.approx(v)
        assert layer.k_scale.device.type == layer.kv_cache[0].device.type  # read on the device
    prompts = _prompts(hf.config.vocab_size)
    outputs = _generate(llm, prompts)
    _assert_matches_reference(_fp8_reference(hf, CKPT_SCALES), prompts, outputs)


def test_kv_scale_single_kv_scale_sets_both(tiny_model, tmp_path):
    """The deprecated single `kv_scale` sets k_scale and v_scale (vLLM)."""
    path, _ = tiny_model
    ckpt = tmp_path / "kv_scale"
    import shutil

    shutil.copytree(path, ckpt)
    state = load_file(str(ckpt / "model.safetensors"))
    state["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.03)
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    llm = _make_llm(str(ckpt), kv_cache_dtype="fp8")
    layer = next(m for m in llm.llm_engine.model_runner.attn_layers if m.layer_idx == 1)
    assert layer.k_scale.item() == pytest.approx(0.03) == layer.v_scale.item()
    other = next(m for m in llm.llm_engine.model_runner.attn_layers if m.layer_idx == 0)
    assert other.k_scale.item() == 1.0 == other.v_scale.item()  # none in the checkpoint


def test_prefix_cache_keeps_fp8_outputs(tiny_model):
    """Prefix-cache hits read fp8 blocks written by earlier requests: the tokens of a run
    without the prefix cache."""
    path, hf = tiny_model
    prompts = _prompts(hf.config.vocab_size, lens=[40, 83, 33], seed=5)
    shared = prompts[1][:64]
    prompts += [shared + p[:9] for p in prompts[:2]]  # hits on 4 full blocks of prompt 1
    plain = _make_llm(path, kv_cache_dtype="fp8", enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in _generate(plain, prompts)]
    del plain
    cached = _make_llm(path, kv_cache_dtype="fp8")
    _generate(cached, prompts[1:2])  # fills the prefix cache
    got = _generate(cached, prompts)
    assert [o.outputs[0].token_ids for o in got] == want
    assert cached.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits >= 64
    _assert_pool_empty(cached)
    del cached


def test_preemption_keeps_fp8_outputs(tiny_model):
    """Preempted requests free their fp8 blocks and recompute into new ones: the tokens of a
    run without preemption (12 usable blocks for 6 requests of up to 6 blocks, as in
    test_llm.py's preemption test)."""
    path, hf = tiny_model
    prompts = _prompts(hf.config.vocab_size, [40, 50, 60, 33, 45, 70], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for blocks in (None, 13):
        llm = _make_llm(path, kv_cache_dtype="fp8", num_gpu_blocks_override=blocks,
                        max_model_len=128, reserve_kv_for_growth=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[blocks] = [o.outputs[0].token_ids for o in outputs]
        assert (llm.llm_engine.scheduler.num_preemptions > 0) == (blocks is not None)
        _assert_pool_empty(llm)
        del llm
    assert runs[13] == runs[None]


@pytest.mark.parametrize("bad", ["fp8_e5m2", "bfloat16", "int8", "fp8_inc"])
def test_bad_kv_cache_dtype_is_refused(tiny_model, bad):
    path, _ = tiny_model
    with pytest.raises(ValueError, match=f"kv_cache_dtype '{bad}' is not supported"):
        _make_llm(path, kv_cache_dtype=bad)


def test_fp8_tensor_parallel_equals_one_rank(tmp_path_factory, tmp_path):
    """TP=2 on the CPU (two worker processes, one KV head each): every rank allocates its fp8
    cache and loads the checkpoint's scales itself; the tokens equal one rank's."""
    from tests.pyorch.executor.test_multiproc_executor import (
        _call_with_deadline,
        _greedy_tokens,
        _llm,
        _tiny_model,
    )

    path, vocab = _tiny_model("llama", tmp_path_factory)
    ckpt = _with_kv_scales(path, tmp_path, "vllm")
    prompts = _prompts(vocab, [1, 7, 17, 40])
    one = _llm(ckpt, kv_cache_dtype="fp8")
    expected = _greedy_tokens(one, prompts)
    one.llm_engine.shutdown()
    two = _llm(ckpt, kv_cache_dtype="fp8", tensor_parallel_size=2)
    try:
        assert _call_with_deadline(_greedy_tokens, two, prompts) == expected
    finally:
        two.llm_engine.shutdown()
