"""Cascade attention: decode steps whose requests share a long cached prefix.

Requests that hit the prefix cache hold the very same KV blocks for their common prefix (a system
prompt, a few-shot preamble, a document asked many questions). Plain paged decode reads those
blocks once per request per step. The cascade splits each request's keys in two:

- the shared prefix of a group, attended by all the group's queries in one non-causal call (one
  "sequence" per group whose query rows are the group members' decode tokens), so its KV is read
  once per group: on the GPU that is the prefill kernel, a tensor-core product with
  group_size x GQA rows per KV tile;
- each request's own suffix (its blocks after the prefix), a normal decode call;

and merges the two partial softmaxes by their log-sum-exps (`merge_attn_states`), which is exact.

`plan_cascade` decides per step, from the host block table, whether the cascade saves enough KV
reads to pay for its extra launches and for leaving the CUDA graph (a cascade step runs eagerly,
so the plain step must be long enough on the device to hide an eager step's host time).
Groups are found without a per-request Python loop: rows sorted by their first block id, each row
compared with its group's first row, and the common prefix of a group is the minimum over its rows.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np

# A group needs this many requests (one prefix read serves them all) ...
MIN_GROUP_SIZE = 4
# ... and a prefix of at least this many tokens (shorter prefixes save little and cost a launch).
MIN_PREFIX_TOKENS = 256
# The step must save this share of its KV reads and at least these many bytes (all layers).
MIN_SAVED_FRACTION = 0.25
MIN_SAVED_BYTES = 256 << 20
# A cascade step runs eagerly, and an eager decode step costs the host about this much per layer
# to launch (Llama-3-8B at batch 1024 with cascade attention on our H100 machine: 16.6 ms for 32
# layers). With async scheduling a step takes max(host, device), so leaving a CUDA graph pays only
# when the device time of the plain step exceeds the eager host time by this margin; the device
# time is estimated as the step's KV and weight reads at HBM_BYTES_PER_S (an H100's).
EAGER_S_PER_LAYER = 0.5e-3
EAGER_MARGIN = 1.25
HBM_BYTES_PER_S = 3.35e12


def min_graph_step_kv_bytes(num_layers: int, weight_bytes: int) -> int:
    """The KV bytes a decode step must read (all layers, without cascade) before leaving its
    CUDA graph for an eager cascade step can pay: see EAGER_S_PER_LAYER."""
    step_bytes = EAGER_MARGIN * num_layers * EAGER_S_PER_LAYER * HBM_BYTES_PER_S
    return max(0, int(step_bytes) - weight_bytes)


@dataclass
class CascadePlan:
    """Host arrays of one cascade step over S decode requests (request i = query row i)."""

    perm: np.ndarray  # [N] int64: the grouped requests, group by group
    prefix_query_start_loc: np.ndarray  # [G + 1] int32: rows of each group within perm
    prefix_seq_lens: np.ndarray  # [G] int32: shared prefix tokens (whole blocks)
    prefix_block_table: np.ndarray  # [G, Wp] int32: the prefix blocks of each group
    suffix_seq_lens: np.ndarray  # [S] int32: tokens after each request's prefix (all of them: 0)
    suffix_block_table: np.ndarray  # [S, W] int32: each row's blocks from its prefix's end on
    saved_tokens: int  # KV token reads saved per layer: sum over groups of (size - 1) * prefix

    @property
    def num_groups(self) -> int:
        return len(self.prefix_seq_lens)

    @property
    def max_group_size(self) -> int:
        return int(np.diff(self.prefix_query_start_loc).max())


def plan_cascade(table: np.ndarray, seq_lens: np.ndarray, block_size: int,
                 kv_bytes_per_token: int, min_step_kv_bytes: int = 0) -> Optional[CascadePlan]:
    """The cascade for a decode step, or None when it would not pay.

    table: [S, W] int32 block ids of the step's requests (columns past a request's blocks are
    anything); seq_lens: [S] tokens each request attends over, this step's token included;
    kv_bytes_per_token: K and V bytes of one token over all layers; min_step_kv_bytes: the KV
    bytes the plain step must read for the cascade to pay (min_graph_step_kv_bytes when the step
    would otherwise replay a CUDA graph, 0 when it runs eagerly anyway)."""
    num_seqs, width = table.shape
    if num_seqs < MIN_GROUP_SIZE or width == 0:
        return None
    seq_lens = seq_lens.astype(np.int64, copy=False)
    order = np.argsort(table[:, 0], kind="stable")
    # Rows in group order (np.take: a row gather many times faster than fancy indexing).
    rows = np.take(table, order, axis=0)
    first = rows[:, 0]
    starts = np.flatnonzero(np.r_[True, first[1:] != first[:-1]])
    counts = np.diff(np.r_[starts, num_seqs])
    if counts.max() < MIN_GROUP_SIZE:
        return None
    # Leading blocks each row shares with its group's first row, capped so that the prefix ends
    # before the block holding the row's newest token (written this step, private to the row).
    same = rows == np.take(rows, np.repeat(starts, counts), axis=0)
    lead = np.where(same.all(axis=1), width, same.argmin(axis=1))
    limit = np.minimum(lead, (np.take(seq_lens, order) - 1) // block_size)
    common = np.minimum.reduceat(limit, starts)
    keep = (counts >= MIN_GROUP_SIZE) & (common * block_size >= MIN_PREFIX_TOKENS)
    if not keep.any():
        return None
    prefix_blocks = common[keep]
    sizes = counts[keep]
    saved_tokens = int(((sizes - 1) * prefix_blocks).sum()) * block_size
    total_tokens = int(seq_lens.sum())
    if (saved_tokens * kv_bytes_per_token < MIN_SAVED_BYTES
            or saved_tokens < MIN_SAVED_FRACTION * total_tokens
            or total_tokens * kv_bytes_per_token < min_step_kv_bytes):
        return None
    # Each grouped row's blocks after its prefix, shifted to the front (a slice copy per group;
    # the columns past them keep stale ids, which the kernels never read).
    suffix_rows = rows.copy()
    shift_sorted = np.zeros(num_seqs, dtype=np.int64)
    for start, size, blocks in zip(starts[keep].tolist(), sizes.tolist(), prefix_blocks.tolist(),
                                   strict=True):
        suffix_rows[start : start + size, : width - blocks] = rows[start : start + size, blocks:]
        shift_sorted[start : start + size] = blocks
    inverse = np.empty_like(order)
    inverse[order] = np.arange(num_seqs)
    shift = np.take(shift_sorted, inverse)
    max_prefix = int(prefix_blocks.max())
    return CascadePlan(
        perm=order[np.repeat(keep, counts)].astype(np.int64),
        prefix_query_start_loc=np.r_[0, np.cumsum(sizes)].astype(np.int32),
        prefix_seq_lens=(prefix_blocks * block_size).astype(np.int32),
        prefix_block_table=np.ascontiguousarray(rows[starts[keep], :max_prefix]),
        suffix_seq_lens=(seq_lens - shift * block_size).astype(np.int32),
        suffix_block_table=np.take(suffix_rows, inverse, axis=0),
        saved_tokens=saved_tokens,
    )
