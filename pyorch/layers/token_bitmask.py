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


class BitmaskStaging:
    """The host side of a step's bitmask copy, reused step after step: one int32 buffer for the
    rows and their indices (pinned on CUDA, so the copy is asynchronous), grown when a step needs
    more, and the event of the last copy out of it (waited for before the buffer is rewritten;
    the engine has by then waited for that step's tokens, so the wait is free)."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None  # [capacity, num_words + 1] int32
        self._event: torch.cuda.Event | None = None

    def rows(self, num_rows: int, num_words: int, pin: bool) -> tuple[np.ndarray, torch.Tensor]:
        """A [num_rows, num_words + 1] int32 host buffer (the last column holds the indices),
        as numpy (to fill) and torch (to copy)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        host = self._host
        if host is None or host.shape[0] < num_rows or host.shape[1] != num_words + 1:
            capacity = max(num_rows, 2 * host.shape[0] if host is not None else 0)
            host = torch.empty((capacity, num_words + 1), dtype=torch.int32, pin_memory=pin)
            self._host = host
        view = host[:num_rows]
        return view.numpy(), view

    def copied(self, device: torch.device) -> None:
        """Records that a non-blocking copy out of the buffer was queued on `device`'s stream."""
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()


_STAGING: dict[str, BitmaskStaging] = {}


def apply_grammar_bitmask(logits: torch.Tensor, sampled_req_ids: list[str],
                          grammar: GrammarOutput) -> None:
    """Masks the constrained rows of logits ([num_sampled, vocab_size], rows in sampled_req_ids
    order) in place with their grammar rows.

    Host work per step: only the constrained rows are written, into a reused (pinned on CUDA)
    staging buffer, and only the rows up to the last constrained one are copied, in one
    non-blocking copy together with the row indices; the kernel masks only those rows."""
    row_of = {req_id: i for i, req_id in enumerate(sampled_req_ids)}
    rows = [row_of.get(req_id, -1) for req_id in grammar.structured_output_request_ids]
    picked = [j for j, i in enumerate(rows) if i >= 0]
    if not picked:
        return
    num_words = grammar.grammar_bitmask.shape[1]
    if num_words != (logits.shape[1] + 31) // 32:
        raise ValueError(f"grammar bitmask has {num_words} words per row for "
                         f"{logits.shape[1]} logits")
    indices = [rows[j] for j in picked]
    num_rows = max(indices) + 1  # rows past the last constrained one are left alone
    device = logits.device
    staging = _STAGING.setdefault(str(device), BitmaskStaging())
    host, host_t = staging.rows(num_rows, num_words, pin=device.type == "cuda")
    # Column num_words, rows 0..k-1: the indices. Rows not constrained are never read (the
    # kernel masks only the indexed rows), so they are not written.
    if len(picked) == len(rows) and indices == list(range(len(indices))):
        host[:, :num_words] = grammar.grammar_bitmask  # rows already in logits order
    else:
        host[indices, :num_words] = grammar.grammar_bitmask[picked]
    host[:len(indices), num_words] = indices
    staged = host_t.to(device, non_blocking=True) if device.type != "cpu" else host_t
    staging.copied(device)
    bitmask_t = staged[:, :num_words]
    indices_t = staged[:len(indices), num_words].contiguous()
    _ops.apply_token_bitmask_inplace(logits[:num_rows], bitmask_t, indices_t)
