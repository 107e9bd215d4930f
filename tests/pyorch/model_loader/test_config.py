"""load_hf_config / get_rope_params on config.json in transformers v4 and v5 forms."""

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from pyorch.model_loader import get_rope_params, load_hf_config

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=100,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
)
ARCHS = {
    "llama": ("LlamaForCausalLM", LlamaConfig),
    "qwen2": ("Qwen2ForCausalLM", Qwen2Config),
    "qwen3": ("Qwen3ForCausalLM", Qwen3Config),
}
# (v4 rope_scaling or None, expected rope params beyond theta)
SCALINGS = {
    "default": (None, {"rope_type": "default"}),
    "linear": ({"type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        None,  # same as written
    ),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        None,
    ),
}


def write_config(folder: Path, data: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))
    return str(folder)


def v4_config(model_type: str, theta: float, scaling: dict | None) -> dict:
    data = dict(TINY, model_type=model_type, architectures=[ARCHS[model_type][0]])
    data.update(rope_theta=theta, torch_dtype="bfloat16")
    if scaling is not None:
        data["rope_scaling"] = scaling
    return data


def expected_params(theta: float, scaling_name: str) -> dict:
    scaling, expected = SCALINGS[scaling_name]
    params = dict(expected if expected is not None else scaling)
    return dict(params, rope_theta=theta)


@pytest.mark.parametrize("model_type", ARCHS)
@pytest.mark.parametrize("scaling_name", SCALINGS)
def test_v4_form(tmp_path: Path, model_type: str, scaling_name: str) -> None:
    theta = 500000.0
    path = write_config(tmp_path, v4_config(model_type, theta, SCALINGS[scaling_name][0]))
    config = load_hf_config(path)
    assert config.architectures == [ARCHS[model_type][0]]
    assert config.model_type == model_type
    assert config.num_key_value_heads == 2 and config.head_dim == 16
    assert get_rope_params(config) == expected_params(theta, scaling_name)
    # The normalized form is stored on the config for anything that reads it directly.
    assert config.rope_parameters["rope_type"] == expected_params(theta, scaling_name)["rope_type"]


@pytest.mark.parametrize("model_type", ARCHS)
@pytest.mark.parametrize("scaling_name", SCALINGS)
def test_v5_form_written_by_transformers(
    tmp_path: Path, model_type: str, scaling_name: str
) -> None:
    # Let the installed transformers write config.json in its own (v5: rope_parameters) form.
    architecture, config_cls = ARCHS[model_type]
    theta = 1000000.0
    rope = dict(expected_params(theta, scaling_name))
    source = config_cls(**TINY, architectures=[architecture], rope_parameters=rope)
    source.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written
    config = load_hf_config(str(tmp_path))
    assert get_rope_params(config) == expected_params(theta, scaling_name)


def test_v5_form_hand_written(tmp_path: Path) -> None:
    data = dict(TINY, model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    data["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    config = load_hf_config(write_config(tmp_path, data))
    assert get_rope_params(config) == {"rope_type": "default", "rope_theta": 1000000.0}


class _Bare:
    """A config object that is neither v4 nor v5 shaped (no rope fields at all)."""


def test_get_rope_params_forms_without_transformers() -> None:
    bare = _Bare()
    assert get_rope_params(bare) == {"rope_type": "default", "rope_theta": 10000.0}
    v4 = _Bare()
    v4.rope_theta, v4.rope_scaling = 5e5, {"type": "su", "short_factor": [1.0]}
    assert get_rope_params(v4) == {
        "rope_type": "longrope",
        "short_factor": [1.0],
        "rope_theta": 5e5,
    }
    layered = _Bare()
    layered.rope_parameters = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    layered.partial_rotary_factor = 0.5
    assert get_rope_params(layered) == {
        "rope_type": "linear",
        "factor": 8.0,
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.5,
    }


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        load_hf_config(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*no config.json"):
        load_hf_config(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_hf_config(str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{not json", "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"hidden_size": 4}', "neither 'model_type' nor 'architectures'"),
        ('{"model_type": "no_such_model_type"}', "no_such_model_type"),
    ],
)
def test_malformed_config_json(tmp_path: Path, text: str, problem: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=problem) as info:
        load_hf_config(str(tmp_path))
    assert str(tmp_path / "config.json") in str(info.value)


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="model.bin.*must be a .gguf file"):
        load_hf_config(str(weights))


# transformers 5's config docstrings import modeling_auto (and torch._dynamo through it); the
# loader hides it while the config class is defined. Checked in a fresh interpreter, since this
# one may have imported it already.
_FRESH_LOAD = r"""
import sys
from pyorch.model_loader import load_hf_config
config = load_hf_config(sys.argv[1])
hidden = "transformers.models.auto.modeling_auto" not in sys.modules
import transformers.models.auto.modeling_auto as later  # importable as usual afterwards
print(type(config).__name__, config.num_key_value_heads, hidden, later.MODEL_MAPPING_NAMES["llama"])
"""


def test_config_load_leaves_model_class_mappings_unimported(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    path = write_config(tmp_path / "m", v4_config("llama", 10000.0, None))
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _FRESH_LOAD, path], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, kv_heads, hidden, mapped = proc.stdout.split()[:4]
    assert (name, kv_heads, hidden) == ("LlamaConfig", "2", "True")
    assert mapped == "LlamaModel"


def test_config_load_falls_back_when_hiding_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A transformers version whose config import needed modeling_auto: the plain call is retried.
    import sys

    import transformers

    real = transformers.AutoConfig.from_pretrained.__func__
    calls = []

    def picky(cls, *args, **kwargs):
        calls.append(sys.modules.get("transformers.models.auto.modeling_auto", "absent"))
        if calls[-1] is None:
            raise ImportError("modeling_auto needed")
        return real(cls, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "transformers.models.auto.modeling_auto", raising=False)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(picky))
    path = write_config(tmp_path / "m", v4_config("qwen2", 10000.0, None))
    config = load_hf_config(path)
    assert type(config).__name__ == "Qwen2Config"
    assert calls[0] is None and calls[1] is not None
    assert "transformers.models.auto.modeling_auto" not in sys.modules or (
        sys.modules["transformers.models.auto.modeling_auto"] is not None)
