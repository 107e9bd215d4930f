"""Sharded safetensors / .bin readers and dummy weights."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from pyorch.model_loader.weight_utils import (
    initialize_dummy_weights,
    iterate_pt_weights,
    iterate_safetensors_weights,
    load_kv_scales,
    maybe_remap_kv_scale_name,
)
from tests.conftest import DEVICES


def make_state(num: int = 7) -> dict[str, torch.Tensor]:
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    return {f"model.layers.{i}.w": torch.randn(3 + i, 5).to(dtypes[i % 3]) for i in range(num)}


def write_shards(folder: Path, state: dict, num_shards: int, with_index: bool) -> None:
    names = list(state)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: state[n] for n in names[shard::num_shards]}
        save_file(part, str(folder / file))
        weight_map.update({n: file for n in part})
    if with_index:
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("num_shards, with_index", [(1, False), (3, True), (3, False)])
def test_safetensors_round_trip(tmp_path: Path, num_shards: int, with_index: bool) -> None:
    state = make_state()
    write_shards(tmp_path, state, num_shards, with_index)
    iterator = iterate_safetensors_weights(str(tmp_path))
    assert not isinstance(iterator, (list, dict))  # lazy
    loaded = dict(iterator)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def test_index_limits_the_files(tmp_path: Path) -> None:
    # A stray safetensors file not named by the index (e.g. consolidated.safetensors) is ignored.
    state = make_state(4)
    write_shards(tmp_path, state, 2, with_index=True)
    save_file({"stray": torch.zeros(1)}, str(tmp_path / "consolidated.safetensors"))
    assert set(dict(iterate_safetensors_weights(str(tmp_path)))) == set(state)


def test_safetensors_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no \\*.safetensors"):
        list(iterate_safetensors_weights(str(tmp_path)))

    write_shards(tmp_path, make_state(4), 2, with_index=True)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="index.json: names shard model-00002-of-00002"):
        list(iterate_safetensors_weights(str(tmp_path)))

    (tmp_path / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(ValueError, match="model.safetensors.index.json: malformed index"):
        list(iterate_safetensors_weights(str(tmp_path)))


def test_corrupt_safetensors_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ValueError, match=f"{bad}: unreadable safetensors file"):
        list(iterate_safetensors_weights(str(tmp_path)))


def test_pt_round_trip_and_error(tmp_path: Path) -> None:
    state = make_state(3)
    torch.save(state, tmp_path / "pytorch_model.bin")
    loaded = dict(iterate_pt_weights(str(tmp_path)))
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[n], state[n]) for n in state)
    (tmp_path / "pytorch_model.bin").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="pytorch_model.bin: unreadable PyTorch checkpoint"):
        list(iterate_pt_weights(str(tmp_path)))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("cache", torch.full((4,), 7.0))
        self.register_buffer("ids", torch.arange(4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dummy_weights(device: str, dtype: torch.dtype) -> None:
    def build() -> Tiny:
        return Tiny().to(device=device, dtype=dtype)

    a, b, c = build(), build(), build()
    initialize_dummy_weights(a, seed=3)
    initialize_dummy_weights(b, seed=3)
    initialize_dummy_weights(c, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert pa.dtype == dtype and pa.device.type == device
        assert pa.abs().max() <= 1e-3 and pa.std() > 0, name
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
    assert a.head.weight is a.embed.weight
    assert torch.equal(a.cache, torch.full((4,), 7.0, device=device, dtype=dtype))


def test_dummy_quantization_scales_are_positive() -> None:
    """A quantized layer's dequantization scales (`*scale`, `*scale_inv`, `scales`) draw in
    [high / 2, high): a scale must be positive; everything else keeps [low, high)."""
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.empty(64, 32).to(torch.float8_e4m3fn), requires_grad=False)
    for name in ("weight_scale", "input_scale", "weight_scale_inv", "scales"):
        layer.register_parameter(name, nn.Parameter(torch.empty(64), requires_grad=False))
    layer.bias = nn.Parameter(torch.empty(64), requires_grad=False)
    initialize_dummy_weights(layer, seed=1)
    for name in ("weight_scale", "input_scale", "weight_scale_inv", "scales"):
        p = getattr(layer, name)
        assert bool(((p >= 5e-4) & (p < 1e-3)).all()), name
    assert layer.bias.min() < 0 < layer.bias.max() and layer.bias.abs().max() <= 1e-3
    # fp8 payloads: [low, high) drawn in fp16 and cast (vLLM's way), so at +-1e-3 they round to
    # zero or to e4m3's smallest subnormal, 2^-9.
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight.float().abs().max() <= 2.0**-9


def test_safetensors_tensors_are_views_of_the_mapped_file(tmp_path: Path) -> None:
    """Zero-copy: tensors of one file sit in one mapping at their file offsets, so narrowing one
    to a tensor-parallel shard before the copy reads only the shard's pages."""
    state = {"a": torch.randn(64, 32), "b": torch.randn(16, dtype=torch.float64),
             "c": torch.arange(6, dtype=torch.int32).view(2, 3), "empty": torch.zeros(0, 4)}
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = dict(iterate_safetensors_weights(str(tmp_path)))
    for name, tensor in state.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)
    header_len = int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little")
    offsets = json.loads((tmp_path / "model.safetensors").read_bytes()[8 : 8 + header_len])
    ptr = {n: loaded[n].data_ptr() for n in ("a", "b", "c")}
    for n in ("b", "c"):
        assert ptr[n] - ptr["a"] == offsets[n]["data_offsets"][0] - offsets["a"]["data_offsets"][0]
    # Writing to a loaded tensor never reaches the file (copy-on-write mapping).
    loaded["a"].zero_()
    again = dict(iterate_safetensors_weights(str(tmp_path)))
    torch.testing.assert_close(again["a"], state["a"], rtol=0, atol=0)


def test_safetensors_bad_offsets_name_the_file(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match="unreadable safetensors file.*do not fit shape"):
        list(iterate_safetensors_weights(str(tmp_path)))
    header = json.dumps({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match="unreadable safetensors file.*KeyError"):
        list(iterate_safetensors_weights(str(tmp_path)))


# ---- fp8 KV-cache scales ------------------------------------------------------------------------
ATTN = {"model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"}


@pytest.mark.parametrize("name,want", [
    ("model.layers.0.self_attn.k_scale", ["model.layers.0.self_attn.attn.k_scale"]),
    ("model.layers.1.self_attn.v_scale", ["model.layers.1.self_attn.attn.v_scale"]),
    ("model.layers.0.self_attn.attn.k_scale", ["model.layers.0.self_attn.attn.k_scale"]),
    ("model.layers.1.self_attn.k_proj.output_scale", ["model.layers.1.self_attn.attn.k_scale"]),
    ("model.layers.1.self_attn.v_proj.output_scale", ["model.layers.1.self_attn.attn.v_scale"]),
    ("model.layers.0.self_attn.k_proj.k_scale", ["model.layers.0.self_attn.attn.k_scale"]),
    ("model.layers.0.self_attn.v_proj.v_scale", ["model.layers.0.self_attn.attn.v_scale"]),
    ("model.layers.0.self_attn.kv_scale",
     ["model.layers.0.self_attn.attn.k_scale", "model.layers.0.self_attn.attn.v_scale"]),
    ("model.layers.0.self_attn.k_proj.weight", None),
    ("model.layers.0.self_attn.k_proj.weight_scale", None),
    ("model.layers.0.mlp.down_proj.input_scale", None),
])  # fmt: skip
def test_maybe_remap_kv_scale_name(name, want):
    assert maybe_remap_kv_scale_name(name, ATTN) == want


def test_maybe_remap_kv_scale_name_unknown_layer():
    with pytest.raises(KeyError, match="model.layers.7.self_attn"):
        maybe_remap_kv_scale_name("model.layers.7.self_attn.k_scale", ATTN)


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from pyorch.layers.attention import Attention

        self.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for i, layer in enumerate(self.layers):
            layer.self_attn = nn.Module()
            layer.self_attn.attn = Attention(4, 64, 0.125, 2, layer_idx=i)
            layer.self_attn.o_proj = nn.Linear(2, 2)


def test_load_kv_scales_sets_buffers_in_place_and_passes_the_rest():
    model = _TwoLayers()
    attn = [layer.self_attn.attn for layer in model.layers]
    before = [a.k_scale.data_ptr() for a in attn]
    weights = [("layers.0.self_attn.k_scale", torch.tensor(0.5)),
               ("layers.0.self_attn.o_proj.weight", torch.ones(2, 2)),
               ("layers.1.self_attn.v_proj.output_scale",
                torch.tensor([0.25], dtype=torch.bfloat16)),
               ("layers.1.self_attn.q_proj.output_scale", torch.tensor([3.0])),
               ("layers.1.self_attn.kv_scale", torch.tensor(0.125))]
    rest = list(load_kv_scales(model, iter(weights)))
    assert [n for n, _ in rest] == ["layers.0.self_attn.o_proj.weight"]
    assert (attn[0].k_scale.item(), attn[0].v_scale.item()) == (0.5, 1.0)
    assert (attn[1].k_scale.item(), attn[1].v_scale.item()) == (0.125, 0.125)  # kv_scale last
    assert [a.k_scale.data_ptr() for a in attn] == before  # the same tensors (CUDA graphs)


@pytest.mark.parametrize("value,match", [
    (torch.tensor([0.1, 0.2]), "only per-tensor scales"),
    (torch.tensor(0.0), "must be positive"),
    (torch.tensor(float("nan")), "must be positive"),
])  # fmt: skip
def test_load_kv_scales_rejects_bad_scales(value, match):
    weights = iter([("layers.0.self_attn.k_scale", value)])
    with pytest.raises(ValueError, match=match):
        list(load_kv_scales(_TwoLayers(), weights))
