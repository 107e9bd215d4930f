"""The structured-output token bitmask on the logits: the runner's glue and the reference.

A bitmask row holds ceil(vocab_size / 32) int32 words; bit t % 32 of word t // 32 allows token
t. `apply_grammar_bitmask` lays a step's grammar rows (one per constrained request that
samples, from the StructuredOutputManager) over the sampler's rows and masks only those rows
with `pyorch._ops.apply_token_bitmask_inplace` (CPU and CUDA kernels). It runs on the logits
after the model (outside any CUDA graph, which ends at the hidden states) and before sampling.
"""

from __future__ import annotations

import numpy as np
import torch

from pyorch import _ops
from pyorch.structured_output.manager import GrammarOutput


def apply_token_bitmask_native(logits: torch.Tensor, bitmask: torch.Tensor,
                               indices: torch.Tensor | None = None) -> None:
    """Pure-PyTorch reference of apply_token_bitmask_inplace (same arguments and effect)."""
    vocab_size = logits.shape[1]
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]
    rows = (torch.arange(logits.shape[0], device=logits.device) if indices is None
            else indices.long())
    sub = logits[rows]
    logits[rows] = sub.masked_fill(~allowed[rows], float("-inf"))


def apply_grammar_bitmask(logits: torch.Tensor, sampled_req_ids: list[str],
                          grammar: GrammarOutput) -> None:
    """Masks the constrained rows of logits ([num_sampled, vocab_size], rows in sampled_req_ids
    order) in place with their grammar rows."""
    row_of = {req_id: i for i, req_id in enumerate(sampled_req_ids)}
    rows = [row_of.get(req_id, -1) for req_id in grammar.structured_output_request_ids]
    picked = [j for j, i in enumerate(rows) if i >= 0]
    if not picked:
        return
    num_words = grammar.grammar_bitmask.shape[1]
    if num_words != (logits.shape[1] + 31) // 32:
        raise ValueError(f"grammar bitmask has {num_words} words per row for "
                         f"{logits.shape[1]} logits")
    indices = np.array([rows[j] for j in picked], dtype=np.int32)
    full = np.full((logits.shape[0], num_words), -1, dtype=np.int32)
    full[indices] = grammar.grammar_bitmask[picked]
    pin = logits.device.type == "cuda"
    bitmask_t = torch.from_numpy(full)
    indices_t = torch.from_numpy(indices)
    if pin:
        bitmask_t = bitmask_t.pin_memory().to(logits.device, non_blocking=True)
        indices_t = indices_t.pin_memory().to(logits.device, non_blocking=True)
    _ops.apply_token_bitmask_inplace(logits, bitmask_t, indices_t)
