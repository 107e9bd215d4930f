"""Tokenizers for Hugging Face directories, hub ids and GGUF files."""

from __future__ import annotations

import os
from typing import Any

from pyorch.model_loader.config import is_gguf
from pyorch.model_loader.gguf_loader import gguf_chat_template, gguf_special_token_ids


def get_tokenizer(
    model: str,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
) -> Any:
    """Load the tokenizer of ``model`` (or of ``tokenizer``, when given).

    A directory or hub id goes through ``transformers.AutoTokenizer``. A ``.gguf`` file goes
    through transformers' GGUF tokenizer conversion (``gguf_file=``); its chat template comes from
    the file's ``tokenizer.chat_template`` metadata when transformers did not carry it over.

    Returns
    -------
    transformers.PreTrainedTokenizerBase
    """
    from transformers import AutoTokenizer

    path = os.path.expanduser(tokenizer or model)
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
