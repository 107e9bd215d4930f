"""Load a model's Hugging Face config, and read its RoPE parameters in one form.

transformers 4 wrote ``rope_theta`` and ``rope_scaling`` (``{"type"|"rope_type": ..., "factor":
...}``) as two top-level fields; transformers 5 writes one ``rope_parameters`` dict that holds
``rope_type``, ``rope_theta`` and the scaling fields. transformers 5 reads both forms into
``rope_parameters``; :func:`get_rope_params` reads either, so models never look at the raw fields.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from pyorch.model_loader.gguf_loader import gguf_to_hf_config

DEFAULT_ROPE_THETA = 10000.0
# Old rope_type spellings -> the names transformers uses now.
_ROPE_TYPE_ALIASES = {"su": "longrope", "mrope": "default"}
# Keys of a rope_parameters dict that name layer types (gemma-style per-layer RoPE).
_LAYER_TYPE_KEYS = ("full_attention", "sliding_attention")


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf")


def _looks_like_path(model: str) -> bool:
    # A hub id is "name" or "org/name"; anything else the user meant as a local path.
    return (
        os.path.isabs(model)
        or model.startswith((".", "~"))
        or model.count("/") > 1
        or is_gguf(model)
        or model.endswith(".json")
    )


def _check_config_json(path: str) -> None:
    """Raise a clear error for a missing or malformed config.json in directory ``path``."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        with open(config_file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_file}: malformed JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{config_file}: expected a JSON object, found {type(data).__name__}")
    if "model_type" not in data and "architectures" not in data:
        raise ValueError(f"{config_file}: has neither 'model_type' nor 'architectures'")


def load_hf_config(
    model: str, revision: str | None = None, trust_remote_code: bool = False
) -> PretrainedConfig:
    """Load the Hugging Face config of ``model``.

    Parameters
    ----------
    model : str
        A directory with ``config.json`` (transformers v4 or v5 form), a ``.gguf`` file
        (llama / qwen2 / qwen3; the config is built from the file's metadata), or a hub id.
    revision, trust_remote_code
        Passed to ``transformers.AutoConfig`` for directories and hub ids.

    Returns
    -------
    transformers.PretrainedConfig
        With ``architectures`` set and ``rope_parameters`` holding at least ``rope_type`` and
        ``rope_theta`` (see :func:`get_rope_params`).

    Raises
    ------
    FileNotFoundError, ValueError
        Naming the file and what is wrong with it.
    """
    model = os.path.expanduser(model)
    if is_gguf(model) or os.path.isfile(model):
        if not os.path.exists(model):
            raise FileNotFoundError(f"model file not found: {model}")
        if not is_gguf(model):
            raise ValueError(f"{model}: a model file must be a .gguf file")
        config = gguf_to_hf_config(model)
    elif os.path.isdir(model):
        _check_config_json(model)
        try:
            config = _auto_config_without_model_docs(model, revision, trust_remote_code)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{os.path.join(model, 'config.json')}: {e}") from e
    elif _looks_like_path(model):
        raise FileNotFoundError(f"model path not found: {model}")
    else:
        config = AutoConfig.from_pretrained(
            model, revision=revision, trust_remote_code=trust_remote_code
        )
    if not getattr(config, "architectures", None):
        raise ValueError(f"{model}: the config names no architectures")
    _normalize_rope(config)
    return config


_MODELING_AUTO = "transformers.models.auto.modeling_auto"


@contextlib.contextmanager
def _model_class_mappings_hidden() -> Iterator[None]:
    """Hide transformers' model-class mappings module while a config class is first defined.

    transformers 5's ``@auto_docstring`` on each config class imports ``modeling_auto`` to name
    the model class in the generated docstring, and that module imports the generation, masking
    and FSDP code and through them torch._dynamo: seconds of a cold start (about 8 s measured on
    the GPU machine's transformers 5.17), for a docstring. The decorator treats an ImportError
    there as "no model classes in this environment"; a ``None`` entry in ``sys.modules`` makes
    the import raise one. Nothing changes once the module is already imported.
    """
    if _MODELING_AUTO in sys.modules:
        yield
        return
    sys.modules[_MODELING_AUTO] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get(_MODELING_AUTO, 0) is None:
            del sys.modules[_MODELING_AUTO]


def _auto_config_without_model_docs(
    model: str, revision: str | None, trust_remote_code: bool
) -> PretrainedConfig:
    """``AutoConfig.from_pretrained`` with the model-class mappings hidden; should a
    transformers version fail that way, the plain call (the docstring import is then paid)."""
    kwargs = {"revision": revision, "trust_remote_code": trust_remote_code}
    try:
        with _model_class_mappings_hidden():
            return AutoConfig.from_pretrained(model, **kwargs)
    except Exception:  # noqa: BLE001 - retried as is below, which raises the real error if any
        return AutoConfig.from_pretrained(model, **kwargs)


def _normalize_rope(config: PretrainedConfig) -> None:
    # transformers 5 has already done this; transformers 4 (or a config class that does not
    # standardize RoPE) gets rope_parameters added so both library versions look alike.
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and any(k in params for k in _LAYER_TYPE_KEYS):
        return
    config.rope_parameters = get_rope_params(config)


def get_rope_params(config: PretrainedConfig) -> dict[str, Any]:
    """The RoPE parameters of ``config``, whichever form it was written in.

    Returns
    -------
    dict
        ``rope_type`` ('default', 'linear', 'dynamic', 'yarn', 'llama3', 'longrope', ...),
        ``rope_theta`` (float), and the type's scaling fields as written (``factor``,
        ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``,
        ``beta_fast``, ``beta_slow``, ``attention_factor``, ...), plus ``partial_rotary_factor``
        when the config sets one. Per-layer-type parameters (``{"full_attention": {...}}``)
        return those of ``full_attention``.
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = getattr(config, "rope_scaling", None)  # transformers 4 form
    params = dict(params or {})
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = dict(params["full_attention"])
    legacy_type = params.pop("type", None)
    rope_type = params.get("rope_type") or legacy_type or "default"
    params["rope_type"] = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    theta = params.get("rope_theta")
    if theta is None:
        theta = getattr(config, "rope_theta", None)
    params["rope_theta"] = float(theta if theta is not None else DEFAULT_ROPE_THETA)
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is not None and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = float(partial)
    return params
