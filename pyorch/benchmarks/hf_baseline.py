"""The transformers baseline: the same model in transformers, and `generate` timed on the same
prompts (greedy, exactly `output_len` new tokens, left padding).

How the model is built, by kind of `--model`:

* a Hugging Face directory: ``AutoModelForCausalLM.from_pretrained(dir, dtype=...)``;
* a .gguf file: ``from_pretrained(dirname, gguf_file=basename)`` (transformers dequantizes it).
  That call insists on `accelerate`; without it we take transformers' own GGUF reader
  (``load_gguf_checkpoint``, the same dequantization) into ``from_config``;
* ``--load-format dummy``: ``AutoModelForCausalLM.from_config(config)``, random weights.

The dtype and device are the ones pyorch ran with.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import torch


def _from_gguf(path: str, dtype: torch.dtype) -> tuple[Any, str]:
    import transformers
    from transformers.utils import is_accelerate_available

    folder, name = os.path.split(os.path.abspath(path))
    if is_accelerate_available():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                                  dtype=dtype)
        return model, "from_pretrained(gguf_file)"
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise RuntimeError(f"GGUF -> transformers: missing {sorted(missing)}, "
                           f"unexpected {sorted(result.unexpected_keys)}")
    if tied:
        model.tie_weights()
    return model, "load_gguf_checkpoint + from_config (accelerate not installed)"


def load_hf_model(model: str, load_format: str, dtype: torch.dtype, device: str,
                  seed: int = 0) -> tuple[Any, str]:
    """The transformers model for `model`, eval mode, on `device`; returns (model, how)."""
    import transformers

    from pyorch.model_loader import is_gguf, load_hf_config

    if load_format == "dummy":
        torch.manual_seed(seed)
        config = load_hf_config(model)
        # Built on the target device: initialising 8B random weights on the host takes minutes.
        with torch.device(device):
            hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        how = "from_config (dummy weights)"
    elif is_gguf(model):
        hf_model, how = _from_gguf(model, dtype)
    else:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        how = "from_pretrained"
    return hf_model.to(device=device, dtype=dtype).eval(), how


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def _left_padded(prompts: Sequence[list[int]], pad_id: int,
                 device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def hf_generate(model: Any, prompts: Sequence[list[int]], output_len: int, batch_size: int,
                device: str) -> dict[str, Any]:
    """Runs greedy `generate` over `prompts` in batches of `batch_size`; every sequence gets
    exactly `output_len` new tokens (min_new_tokens = max_new_tokens). Returns the timing."""
    pad_id = model.config.pad_token_id
    if pad_id is None:
        eos = model.config.eos_token_id
        pad_id = (eos[0] if isinstance(eos, list) else eos) or 0
    output_tokens = 0
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        ids, mask = _left_padded(batch, pad_id, device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id,
                             num_beams=1)
        new = out.shape[1] - ids.shape[1]
        if new != output_len:
            raise RuntimeError(f"transformers generated {new} tokens, expected {output_len}")
        output_tokens += new * len(batch)
    _sync(device)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": output_tokens}


def warm_up(model: Any, prompt: list[int], device: str) -> None:
    hf_generate(model, [prompt], output_len=4, batch_size=1, device=device)
