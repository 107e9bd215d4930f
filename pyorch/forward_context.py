"""Per-step state shared by every layer of one forward pass (vLLM's forward context).

The model runner builds one `AttentionMetadata` per step, on the model's device, and enters
`set_forward_context(attn_metadata)` around `model(input_ids, positions)`. Attention layers read it
with `get_forward_context().attn_metadata`, so metadata is never threaded through model signatures.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class CascadeMetadata:
    """A decode step's cascade (pyorch/executor/cascade.py): groups of requests that share a
    cached prefix attend to it once per group, then to their own suffix, and the two partial
    softmaxes are merged. Row i of the step is request i (every request decodes one token)."""

    perm: torch.Tensor  # [N] int64: query rows of the grouped requests, group by group
    prefix_query_start_loc: torch.Tensor  # [G + 1] int32: each group's rows within perm
    prefix_seq_lens: torch.Tensor  # [G] int32: the shared prefix's tokens (whole blocks)
    prefix_block_table: torch.Tensor  # [G, Wp] int32: the prefix's blocks
    prefix_max_query_len: int  # the largest group
    prefix_max_seq_len: int
    suffix_seq_lens: torch.Tensor  # [S] int32: each request's tokens after its prefix
    suffix_block_table: torch.Tensor  # [S, W] int32: each request's blocks after its prefix
    suffix_max_seq_len: int


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache. Owned by the model runner.

    A batch is a concatenation of sequences; sequence i owns the query rows
    `query_start_loc[i]:query_start_loc[i + 1]`, which are its last new tokens: its KV for
    positions `[0, seq_lens[i])` is in the cache once this step's tokens are written.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset, -1 = padding
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens per sequence
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32: block ids per sequence
    max_query_len: int  # max over sequences of their new tokens this step
    max_seq_len: int  # max of seq_lens
    cascade: Optional[CascadeMetadata] = None  # a decode step over shared prefixes

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class ForwardContext:
    """State of the forward pass in flight. attn_metadata is None in a profiling or dummy run
    without a KV cache: attention layers then skip the cache and return zeros."""

    attn_metadata: AttentionMetadata | None


_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None) -> Iterator[ForwardContext]:
    """Makes `attn_metadata` visible to every layer for the duration of the block (re-entrant:
    the previous context is restored on exit)."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata=attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    """The context set by the innermost `set_forward_context`; raises outside of one."""
    if _forward_context is None:
        raise RuntimeError(
            "No forward context is set: run the model inside `with set_forward_context(...)`."
        )
    return _forward_context
