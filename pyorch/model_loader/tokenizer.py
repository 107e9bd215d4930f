"""Tokenizers for Hugging Face directories, hub ids and GGUF files."""

from __future__ import annotations

import json
import os
from typing import Any

from pyorch.model_loader.config import is_gguf
from pyorch.model_loader.gguf_loader import gguf_chat_template, gguf_special_token_ids


def get_tokenizer(
    model: str,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    tokenizer_mode: str = "auto",
) -> Any:
    """Load the tokenizer of ``model`` (or of ``tokenizer``, when given).

    A directory or hub id goes through ``transformers.AutoTokenizer``, except a local directory
    whose ``tokenizer_config.json`` names transformers' generic ``tokenizer.json`` class: that
    class is built directly (see :func:`_generic_tokenizer_class`). A ``.gguf`` file goes through
    transformers' GGUF tokenizer conversion (``gguf_file=``); its chat template comes from the
    file's ``tokenizer.chat_template`` metadata when transformers did not carry it over.

    ``tokenizer_mode`` is vLLM's: ``auto``/``hf`` take the fast (Rust) tokenizer where there
    is one, ``slow`` the Python one (a ValueError when the model has none: no silent fallback).

    Returns
    -------
    transformers.PreTrainedTokenizerBase
    """
    if tokenizer_mode not in ("auto", "hf", "slow"):
        raise ValueError(f"tokenizer_mode {tokenizer_mode!r} is not supported (auto, hf, slow)")
    path = os.path.expanduser(tokenizer or model)
    if tokenizer_mode == "slow":
        return _slow_tokenizer(path, trust_remote_code, revision)
    generic = _generic_tokenizer_class(path)
    if generic is not None:
        return generic.from_pretrained(path, revision=revision)

    from transformers import AutoTokenizer

    if is_gguf(path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer GGUF file not found: {path}")
        try:
            tok = AutoTokenizer.from_pretrained(
                os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
            )
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"{path}: cannot build a tokenizer from this GGUF file ({e})") from e
        _apply_gguf_special_tokens(tok, path)
        if not getattr(tok, "chat_template", None):
            template = gguf_chat_template(path)
            if template:
                tok.chat_template = template
        return tok
    if os.path.isfile(path):
        raise ValueError(f"{path}: a tokenizer is a directory, a hub id or a .gguf file")
    return AutoTokenizer.from_pretrained(
        path, trust_remote_code=trust_remote_code, revision=revision
    )


def _slow_tokenizer(path: str, trust_remote_code: bool, revision: str | None) -> Any:
    from transformers import AutoTokenizer

    if is_gguf(path):
        raise ValueError(f"tokenizer_mode 'slow': a GGUF file ({path}) has no slow tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                            revision=revision, use_fast=False)
    except (ValueError, ImportError) as e:
        raise ValueError(f"tokenizer_mode 'slow': {path} has no slow tokenizer ({e})") from e
    if getattr(tok, "is_fast", False):
        raise ValueError(f"tokenizer_mode 'slow': {path} has no slow (Python) tokenizer, only "
                         "a fast one; use tokenizer_mode 'auto'")
    return tok


# tokenizer_class values that name transformers' generic tokenizer.json-backed class (in
# transformers 5 both resolve to TokenizersBackend), which AutoTokenizer would build as well.
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _generic_tokenizer_class(path: str) -> Any:
    """The generic tokenizer class for a local directory that asks for it, else None.

    Importing ``AutoTokenizer`` imports transformers' model-class mappings; on transformers 5.17
    that pulls in its generation, FSDP and masking modules, and through them torch._dynamo and
    sympy: seconds of a cold start, for a class the directory names outright. Directories with
    remote code (``auto_map``), without ``tokenizer.json`` or naming any other class go through
    AutoTokenizer.
    """
    config_path = os.path.join(path, "tokenizer_config.json")
    if not (os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json"))
            and os.path.isfile(config_path)):
        return None
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # AutoTokenizer reports a broken file better
    name = config.get("tokenizer_class")
    if name not in _GENERIC_TOKENIZER_CLASSES or "auto_map" in config:
        return None
    import transformers

    return getattr(transformers, name, None)


def _apply_gguf_special_tokens(tok: Any, path: str) -> None:
    """Make the tokenizer's bos/eos/unk/pad tokens those the GGUF file names.

    transformers versions differ in how their GGUF conversion maps these (one of ours, on the GPU
    image, set eos to bos for SmolLM2); the file's ``tokenizer.ggml.*_token_id`` is the truth.
    """
    for role, token_id in gguf_special_token_ids(path).items():
        if token_id is None or not 0 <= token_id < len(tok):
            continue
        if getattr(tok, f"{role}_token_id", None) != token_id:
            setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(token_id))
