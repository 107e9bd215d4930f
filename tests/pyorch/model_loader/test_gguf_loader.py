"""GGUF config building, tensor-name mapping and q/k un-permutation.

Small synthetic GGUF files are written with gguf-py's GGUFWriter; the default model (SmolLM2 Q4_1)
is checked against transformers' own GGUF loading, tensor by tensor.
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from pyorch.layers.quantization.gguf import FLOAT_TYPES, ggml_type_of
from pyorch.model_loader import default_model_path, get_rope_params, load_hf_config
from pyorch.model_loader.gguf_loader import (
    _llama3_rope_from_factors,
    gguf_name_to_hf,
    iterate_gguf_weights,
    unpermute_qk,
)
from tests.reference import gguf as gguf_ref

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 64, 4, 2, 16, 96, 50, 2


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows (GGUF spec: rotary pairs interleaved)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def dequantized(weight: torch.Tensor, cols: int) -> torch.Tensor:
    """A loaded GGUF weight as float32 values: blocks through gguf's own dequantization."""
    if weight.dtype != torch.uint8:
        return weight.float()
    ggml_type = ggml_type_of(weight)
    assert ggml_type not in FLOAT_TYPES
    values = gguf_dequantize(weight.numpy(), Q(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(weight.shape[0], cols)


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, orig: int):
    """llama3 rope divisors per frequency, as llama.cpp stores them in rope_freqs.weight."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_weights(arch: str, rng: np.random.Generator, tied: bool) -> dict[str, np.ndarray]:
    """Random HF-named weights of a tiny model, float32, torch shapes."""

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": w(HIDDEN)}
    if not tied:
        out["lm_head.weight"] = w(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": w(HIDDEN),
                p + "post_attention_layernorm.weight": w(HIDDEN),
                p + "self_attn.q_proj.weight": w(q_rows, HIDDEN),
                p + "self_attn.k_proj.weight": w(kv_rows, HIDDEN),
                p + "self_attn.v_proj.weight": w(kv_rows, HIDDEN),
                p + "self_attn.o_proj.weight": w(HIDDEN, q_rows),
                p + "mlp.gate_proj.weight": w(INTER, HIDDEN),
                p + "mlp.up_proj.weight": w(INTER, HIDDEN),
                p + "mlp.down_proj.weight": w(HIDDEN, INTER),
            }
        )
        if arch == "qwen2":
            for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                out[p + f"self_attn.{proj}_proj.bias"] = w(rows)
        if arch == "qwen3":
            out[p + "self_attn.q_norm.weight"] = w(HEAD_DIM)
            out[p + "self_attn.k_norm.weight"] = w(HEAD_DIM)
    return out


GGUF_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def to_gguf_name(hf_name: str) -> str:
    """Test-side inverse of the name map (written independently of the library's table)."""
    fixed = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    base, kind = hf_name.rsplit(".", 1)
    if base in fixed:
        return f"{fixed[base]}.{kind}"
    _, _, layer, part = base.split(".", 3)
    return f"blk.{layer}.{GGUF_PARTS[part]}.{kind}"


def write_gguf(path: Path, arch: str, weights: dict, extra=None, metadata=True, q8_0=()) -> str:
    """Write ``weights`` (HF names) to a GGUF file as llama.cpp's converter would."""
    if metadata:
        writer = gguf_ref.llama_family_writer(path, arch, layers=LAYERS, hidden=HIDDEN, inter=INTER,
                                              heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                              rope_base=500000.0)
        writer.add_bos_token_id(3)
        writer.add_eos_token_id(4)
    else:
        writer = GGUFWriter(str(path), arch)
    for fn in extra or ():
        fn(writer)
    for name, value in weights.items():
        if arch == "llama" and ".q_proj." in name:
            value = llama_cpp_permute(value, HEADS)
        if arch == "llama" and ".k_proj." in name:
            value = llama_cpp_permute(value, KV_HEADS)
        if name in q8_0:
            writer.add_tensor(to_gguf_name(name), quantize(value, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(to_gguf_name(name), value)
    gguf_ref.finish_gguf(writer)
    return str(path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_config_and_weights(tmp_path: Path, arch: str) -> None:
    rng = np.random.default_rng(0)
    tied = arch == "qwen3"
    weights = hf_weights(arch, rng, tied)
    q8 = {"model.layers.1.mlp.down_proj.weight"}
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, weights, q8_0=q8)

    config = load_hf_config(path)
    expected_cls = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
    assert config.architectures == [expected_cls[arch]] and config.model_type == arch
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        VOCAB,
        HIDDEN,
        INTER,
    )
    assert (config.num_hidden_layers, config.num_attention_heads) == (LAYERS, HEADS)
    assert (config.num_key_value_heads, config.head_dim) == (KV_HEADS, HEAD_DIM)
    assert config.rms_norm_eps == 1e-6 and config.max_position_embeddings == 2048
    assert get_rope_params(config) == {"rope_type": "default", "rope_theta": 500000.0}
    assert config.tie_word_embeddings == tied
    assert (config.bos_token_id, config.eos_token_id) == (3, 4)

    loaded = dict(iterate_gguf_weights(path))
    assert loaded.keys() == weights.keys()
    for name, expected in weights.items():
        got = loaded[name]
        if name in q8:  # quantized: the file's blocks, tagged Q8_0, rows un-permuted
            assert got.dtype == torch.uint8 and ggml_type_of(got) == Q.Q8_0, name
            expected = gguf_dequantize(quantize(expected, Q.Q8_0), Q.Q8_0)
            got = dequantized(got, expected.shape[-1])
        elif expected.ndim == 2:  # a float matrix stays float, tagged F32
            assert ggml_type_of(got) == Q.F32, name
        assert got.dtype == torch.float32 and tuple(got.shape) == expected.shape, name
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=name)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    for rows_heads, cols in ((4, (64,)), (2, ())):  # a weight and a bias
        w = torch.randn(rows_heads * HEAD_DIM, *cols)
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), rows_heads))
        assert not torch.equal(permuted, w)
        torch.testing.assert_close(unpermute_qk(permuted, rows_heads), w, rtol=0, atol=0)


def test_rope_scaling_metadata(tmp_path: Path) -> None:
    weights = hf_weights("qwen2", np.random.default_rng(1), tied=True)

    def yarn(writer: GGUFWriter) -> None:
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(512)

    config = load_hf_config(write_gguf(tmp_path / "yarn.gguf", "qwen2", weights, extra=[yarn]))
    assert get_rope_params(config) == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "rope_theta": 500000.0,
    }


def test_llama3_rope_freqs_tensor(tmp_path: Path) -> None:
    weights = hf_weights("llama", np.random.default_rng(2), tied=True)
    factors = llama3_factors(500000.0, HEAD_DIM, factor=8.0, low=1.0, high=32.0, orig=8192)
    weights_and_freqs = dict(weights)
    path = tmp_path / "llama3.gguf"

    def freqs(writer: GGUFWriter) -> None:
        writer.add_tensor("rope_freqs.weight", factors)

    config = load_hf_config(write_gguf(path, "llama", weights_and_freqs, extra=[freqs]))
    assert get_rope_params(config) == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 32.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    assert "rope_freqs.weight" not in dict(iterate_gguf_weights(str(path)))


def test_llama3_rope_from_llama31_shape() -> None:
    # Llama 3.1 8B: theta 5e5, head_dim 128, factor 8, low 1, high 4, original 8192.
    factors = llama3_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    params = _llama3_rope_from_factors(factors, 500000.0, 128, 8192)
    assert (params["factor"], params["low_freq_factor"], params["high_freq_factor"]) == (
        8.0,
        1.0,
        4.0,
    )
    with pytest.raises(ValueError, match="llama3"):
        _llama3_rope_from_factors(np.linspace(1, 3, 64, dtype=np.float32), 500000.0, 128, 8192)


def test_name_mapping() -> None:
    assert gguf_name_to_hf("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_name_to_hf("output.weight") == "lm_head.weight"
    assert gguf_name_to_hf("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert gguf_name_to_hf("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert gguf_name_to_hf("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        gguf_name_to_hf("blk.0.ffn_gate_exps.weight")


def test_bad_gguf_files(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=f"{garbage}: not a readable GGUF file"):
        load_hf_config(str(garbage))

    weights = hf_weights("llama", np.random.default_rng(3), tied=True)
    good = Path(write_gguf(tmp_path / "good.gguf", "llama", weights))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"{truncated}"):
        load_hf_config(str(truncated))

    bare = write_gguf(tmp_path / "bare.gguf", "llama", weights, metadata=False)
    with pytest.raises(ValueError, match="bare.gguf: GGUF metadata lacks 'llama.embedding_length'"):
        load_hf_config(bare)

    other = write_gguf(tmp_path / "gemma.gguf", "gemma", weights)
    with pytest.raises(ValueError, match="gemma.gguf: architecture 'gemma' is not supported"):
        load_hf_config(other)

    odd = dict(weights, **{"model.layers.0.mlp.extra.weight": np.zeros(4, np.float32)})
    GGUF_PARTS["mlp.extra"] = "ffn_extra"
    try:
        odd_path = write_gguf(tmp_path / "odd.gguf", "llama", odd)
    finally:
        del GGUF_PARTS["mlp.extra"]
    with pytest.raises(ValueError, match="blk.0.ffn_extra.weight"):
        list(iterate_gguf_weights(odd_path))


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_smollm2_config(smollm2_path: str) -> None:
    config = load_hf_config(smollm2_path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (49152, 576, 1536)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        30,
        9,
        3,
    )
    assert config.head_dim == 64 and config.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == 8192 and config.tie_word_embeddings
    assert get_rope_params(config) == {"rope_type": "default", "rope_theta": 100000.0}
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_smollm2_weights_match_transformers(smollm2_path: str) -> None:
    """Our blocks (through gguf's dequantization) + names + un-permutation == transformers' GGUF
    loading, per tensor."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        LlamaTensorProcessor,
        get_gguf_hf_weights_map,
    )

    from pyorch.model_loader.gguf_loader import open_gguf

    config = load_hf_config(smollm2_path)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    processor = LlamaTensorProcessor(config=config.to_dict())
    name_map = get_gguf_hf_weights_map(hf_model, processor)
    reader = open_gguf(smollm2_path)
    types = {t.tensor_type for t in reader.tensors}
    assert types == {Q.Q4_1, Q.Q8_0, Q.F32}

    ours = iterate_gguf_weights(smollm2_path)
    for tensor in reader.tensors:
        name, got = next(ours)
        ref = processor.process(
            weights=gguf_dequantize(tensor.data, tensor.tensor_type),
            name=tensor.name,
            tensor_key_mapping=name_map,
            parsed_parameters={},
        )
        assert name == name_map[ref.name], tensor.name
        expected = torch.from_numpy(np.array(ref.weights))
        if tensor.tensor_type != Q.F32:
            assert got.dtype == torch.uint8 and ggml_type_of(got) == tensor.tensor_type, name
        assert torch.equal(dequantized(got, expected.shape[-1]), expected), name
    assert next(ours, None) is None
    assert set(hf_model.state_dict()) - set(name_map.values()) <= {"lm_head.weight"}


# ---- mixture-of-experts GGUF files (qwen3moe; llama with experts = Mixtral) -------------------
MOE_EXPERTS, MOE_TOP_K, MOE_INTER = 6, 2, 32


def _tiny_hf_moe(model_type: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  rms_norm_eps=1e-6, rope_theta=500000.0, max_position_embeddings=2048,
                  tie_word_embeddings=False)
    if model_type == "qwen3_moe":
        config = Qwen3MoeConfig(**common, intermediate_size=INTER, num_experts=MOE_EXPERTS,
                                num_experts_per_tok=MOE_TOP_K, moe_intermediate_size=MOE_INTER,
                                norm_topk_prob=True)
    else:
        config = MixtralConfig(**common, intermediate_size=MOE_INTER,
                               num_local_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".gate.weight"):  # decisive routing
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.08)
    return model


def _hf_expert_matrices(state: dict[str, torch.Tensor], layer: int, module: str, part: str,
                        model_type: str) -> np.ndarray:
    """[E, rows, cols] of one projection of every expert, whatever layout transformers keeps."""
    names = {"qwen3_moe": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
             "mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}[model_type]
    p = f"model.layers.{layer}.{module}.experts."
    if p + "0." + names[part] + ".weight" in state:  # per-expert tensors
        return np.stack([state[f"{p}{e}.{names[part]}.weight"].numpy()
                         for e in range(MOE_EXPERTS)])
    if part == "down":  # transformers v5 keeps them stacked
        return state[p + "down_proj"].numpy()
    gate_up = state[p + "gate_up_proj"].numpy()
    return gate_up[:, :MOE_INTER] if part == "gate" else gate_up[:, MOE_INTER:]


def _write_moe_gguf(path: Path, model_type: str, hf) -> tuple[str, dict[str, np.ndarray]]:  # type: ignore[no-untyped-def]
    """The HF model as llama.cpp's converter writes it: per-layer expert tensors stacked into
    ffn_{gate,up,down}_exps ([E, rows, cols]; ffn_down_exps of layer 1 in Q8_0), the router as
    ffn_gate_inp. Returns (path, the expected per-expert HF tensors)."""
    arch = "qwen3moe" if model_type == "qwen3_moe" else "llama"
    # The checkpoint names the loader yields (Mixtral's on-disk block_sparse_moe) and the module
    # name of transformers' state dict (v5 keeps Mixtral's block as mlp in memory).
    module = "mlp" if model_type == "qwen3_moe" else "block_sparse_moe"
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    hf_module = module if any(f".{module}." in k for k in state) else "mlp"
    proj = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
    writer = gguf_ref.llama_family_writer(
        path, arch, layers=LAYERS, hidden=HIDDEN,
        inter=INTER if model_type == "qwen3_moe" else MOE_INTER, heads=HEADS, kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, rope_base=500000.0)
    writer.add_expert_count(MOE_EXPERTS)
    writer.add_expert_used_count(MOE_TOP_K)
    if model_type == "qwen3_moe":
        writer.add_expert_feed_forward_length(MOE_INTER)
    expected: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if ".experts." in name or name.endswith(".experts.gate_up_proj") or name.endswith(
                ".experts.down_proj"):
            continue
        array = value.numpy()
        if name.endswith(f"{hf_module}.gate.weight"):
            layer = name.split(".")[2]
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", array)
            expected[f"model.layers.{layer}.{module}.gate.weight"] = array
            continue
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, HEADS)
        if arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, KV_HEADS)
        writer.add_tensor(to_gguf_name(name), array)
        expected[name] = value.numpy()
    for layer in range(LAYERS):
        for part, hf_proj in zip(("gate", "up", "down"), proj[model_type], strict=True):
            stacked = _hf_expert_matrices(state, layer, hf_module, part, model_type)
            gguf_name = f"blk.{layer}.ffn_{part}_exps.weight"
            if layer == 1 and part == "down":
                blocks = quantize(stacked, Q.Q8_0)
                writer.add_tensor(gguf_name, blocks, raw_dtype=Q.Q8_0)
                stacked = gguf_dequantize(blocks, Q.Q8_0)
            else:
                writer.add_tensor(gguf_name, stacked)
            for e in range(MOE_EXPERTS):
                expected[f"model.layers.{layer}.{module}.experts.{e}.{hf_proj}.weight"] = stacked[e]
    gguf_ref.finish_gguf(writer)
    return str(path), expected


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_moe_gguf_config_weights_and_greedy_output(tmp_path: Path, model_type: str) -> None:
    """An MoE GGUF loads: the config from the expert metadata, the stacked expert tensors
    dequantized and split per expert under the HF names, and the model generates what
    transformers generates from the same weights (greedy, float32, CPU)."""
    from pyorch import LLM, SamplingParams

    hf = _tiny_hf_moe(model_type)
    path, expected = _write_moe_gguf(tmp_path / f"{model_type}.gguf", model_type, hf)
    config = load_hf_config(path)
    assert config.model_type == model_type
    if model_type == "qwen3_moe":
        assert (config.num_experts, config.moe_intermediate_size, config.norm_topk_prob) == (
            MOE_EXPERTS, MOE_INTER, True)
    else:
        assert (config.num_local_experts, config.intermediate_size) == (MOE_EXPERTS, MOE_INTER)
    assert config.num_experts_per_tok == MOE_TOP_K

    loaded = dict(iterate_gguf_weights(path))
    assert loaded.keys() == expected.keys()
    for name, want in expected.items():
        got = loaded[name]
        if ".experts." in name or ".gate.weight" in name:  # dequantized / float for FusedMoE
            assert got.dtype == torch.float32 and not hasattr(got, "ggml_type"), name
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=0, err_msg=name)

    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", max_model_len=128, seed=0,
              kv_cache_memory_bytes=16 << 20)
    prompts = [[1, 5, 9, 13, 2], [7, 3, 3, 40, 21, 8, 11]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                               min_new_tokens=8)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == want


def test_moe_gguf_unsupported_architecture_is_named(tmp_path: Path) -> None:
    writer = GGUFWriter(str(tmp_path / "q2moe.gguf"), "qwen2moe")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), np.float32))
    gguf_ref.finish_gguf(writer)
    with pytest.raises(ValueError, match="architecture 'qwen2moe' is not supported"):
        load_hf_config(str(tmp_path / "q2moe.gguf"))
