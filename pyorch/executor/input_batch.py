"""Per-request state the model runner keeps across steps, and the packed per-step inputs.

Who owns what (see also pyorch/core/scheduler_output.py):
- The scheduler owns requests, blocks and token budgets; each step it sends a `SchedulerOutput`
  diff (new requests with their block ids, new block ids for running ones, tokens to run).
- The runner owns `CachedRequestState` (token ids, block ids, sampling state) for every request
  it has been sent and not yet told to drop. It appends the tokens it samples itself.
- `StepInputs` is rebuilt each step in ONE pinned host buffer (numpy views over it), copied to the
  device with one non-blocking copy, and viewed there as typed tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from pyorch.layers.sampler import SamplingRow
from pyorch.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: Optional[torch.Generator]
    block_ids: list[int]
    num_computed_tokens: int
    # Tokens sampled by launched steps whose values have not reached the host yet (async
    # scheduling): positions [num_tokens, num_tokens + num_pending) are known only on the device.
    num_pending: int = 0
    table_row: int = -1  # this request's row of the runner's BlockTable
    # token ids as a growing numpy array: prompt then outputs (avoids list concatenation per step)
    token_ids: np.ndarray = field(init=False)
    num_tokens: int = field(init=False)
    # The sampler's view of the request, made once: it reads the live token lists above.
    sampling_row: SamplingRow = field(init=False)

    def __post_init__(self) -> None:
        self.sampling_row = SamplingRow(self.sampling_params, self.prompt_token_ids,
                                        self.output_token_ids, self.generator)
        n = len(self.prompt_token_ids) + len(self.output_token_ids)
        self.token_ids = np.empty(max(16, 2 * n), dtype=np.int64)
        self.token_ids[: len(self.prompt_token_ids)] = self.prompt_token_ids
        self.token_ids[len(self.prompt_token_ids) : n] = self.output_token_ids
        self.num_tokens = n

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_token(self, token_id: int) -> None:
        if self.num_tokens == len(self.token_ids):
            grown = np.empty(2 * len(self.token_ids), dtype=np.int64)
            grown[: self.num_tokens] = self.token_ids[: self.num_tokens]
            self.token_ids = grown
        self.token_ids[self.num_tokens] = token_id
        self.num_tokens += 1
        self.output_token_ids.append(token_id)


class BlockTable:
    """Block ids of every request the runner holds, one row each ([rows, max_blocks] int32,
    zeros past a request's blocks), updated from the scheduler's diffs; a step gathers its
    rows with one indexed copy. Rows are recycled; the table grows if more are needed."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int):
        self.table = np.zeros((max(1, num_rows), max_blocks_per_seq), dtype=np.int32)
        self._free = list(range(len(self.table) - 1, -1, -1))

    def acquire(self) -> int:
        if not self._free:
            old = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free = list(range(len(self.table) - 1, old - 1, -1))
        return self._free.pop()

    def append(self, row: int, num_blocks: int, block_ids: list[int]) -> None:
        self.table[row, num_blocks : num_blocks + len(block_ids)] = block_ids

    def release(self, row: int, num_blocks: int) -> None:
        self.table[row, :num_blocks] = 0
        self._free.append(row)


# Layout of the packed step buffer: (name, dtype); sizes are given per step.
_FIELDS = (
    ("input_ids", np.int64),
    ("positions", np.int64),
    ("slot_mapping", np.int64),
    ("logits_indices", np.int64),
    ("query_start_loc", np.int32),
    ("seq_lens", np.int32),
    ("block_table", np.int32),
    # (async scheduling) input_ids[pending_dst[k]] = previous step's sampled[pending_src[k]]
    ("pending_dst", np.int64),
    ("pending_src", np.int64),
    # A cascade decode step's (pyorch/executor/cascade.py); empty otherwise. Last, so that the
    # fields above sit at the same offsets with or without them (the CUDA graphs' addresses).
    ("cascade_perm", np.int64),
    ("prefix_query_start_loc", np.int32),
    ("prefix_seq_lens", np.int32),
    ("prefix_block_table", np.int32),
    ("suffix_seq_lens", np.int32),
    ("suffix_block_table", np.int32),
)
_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32}


class StepBuffers:
    """A pinned host byte buffer and its device twin, sized for the largest step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: str):
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = torch.device(device)
        table_size = max_seqs * max_blocks_per_seq
        counts = self._counts(max_tokens, max_seqs, table_size, (max_seqs, max_seqs, table_size))
        nbytes = sum(np.dtype(dt).itemsize * n + 8 for (_, dt), n in
                     zip(_FIELDS, counts, strict=True))
        pin = self.device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.dev = self.host if self.device.type == "cpu" else torch.empty(
            nbytes, dtype=torch.uint8, device=self.device
        )
        # Marks the end of the last host -> device copy: the host buffer may not be rewritten
        # before it (a step that samples nothing never synchronizes otherwise).
        self._copy_done: Optional[torch.cuda.Event] = None

    @staticmethod
    def _counts(num_tokens: int, num_seqs: int, table_size: int,
                cascade: Optional[tuple[int, int, int]] = None) -> list[int]:
        grouped, groups, prefix_table = cascade or (0, 0, 0)
        suffix = (num_seqs, table_size) if cascade else (0, 0)
        return [num_tokens, num_tokens, num_tokens, num_seqs, num_seqs + 1, num_seqs, table_size,
                num_seqs, num_seqs, grouped, groups + 1 if cascade else 0, groups, prefix_table,
                *suffix]

    def layout(self, num_tokens: int, num_seqs: int, table_width: int,
               cascade: Optional[tuple[int, int, int]] = None) -> dict[str, tuple]:
        """Byte offsets of each field for this step's sizes (8-byte aligned). cascade: (grouped
        requests, groups, prefix block-table entries) of a cascade step."""
        out: dict[str, tuple] = {}
        offset = 0
        counts = self._counts(num_tokens, num_seqs, num_seqs * table_width, cascade)
        for (name, dt), n in zip(_FIELDS, counts, strict=True):
            out[name] = (offset, n, dt)
            offset += -(-np.dtype(dt).itemsize * n // 8) * 8
        out["_total"] = (offset, 0, None)
        return out

    def host_views(self, layout: dict[str, tuple]) -> dict[str, np.ndarray]:
        if self._copy_done is not None:
            self._copy_done.synchronize()
            self._copy_done = None
        views = {}
        for name, (offset, n, dt) in layout.items():
            if dt is not None:
                nbytes = np.dtype(dt).itemsize * n
                views[name] = self.host_np[offset : offset + nbytes].view(dt)
        return views

    def to_device(self, layout: dict[str, tuple]) -> dict[str, torch.Tensor]:
        """Copies the host buffer's first layout bytes to the device (one non-blocking copy) and
        returns the device views."""
        total = layout["_total"][0]
        if self.dev is not self.host:
            self.dev[:total].copy_(self.host[:total], non_blocking=True)
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()
        return self.device_views(layout)

    def device_views(self, layout: dict[str, tuple]) -> dict[str, torch.Tensor]:
        """Typed device views of a layout; the same layout always gives the same addresses (what
        a CUDA graph captured over them reads)."""
        tensors = {}
        for name, (offset, n, dt) in layout.items():
            if dt is not None:
                nbytes = np.dtype(dt).itemsize * n
                tensors[name] = self.dev[offset : offset + nbytes].view(_TORCH_DTYPES[dt])
        return tensors
