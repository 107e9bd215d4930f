"""Test helper: block tables, slot mapping and AttentionMetadata for a hand-made batch."""

import torch

from pyorch.forward_context import AttentionMetadata


def allocate_blocks(
    max_seq_lens: list[int], block_size: int, shuffle: bool = False
) -> tuple[list[list[int]], int]:
    """Blocks for sequences that grow up to max_seq_lens tokens: contiguous runs, or a random
    permutation (shuffle). Block 0 is left unused, as the engine reserves it. Returns the block
    ids per sequence and the number of blocks a cache needs."""
    counts = [-(-n // block_size) for n in max_seq_lens]
    ids = torch.arange(1, sum(counts) + 1)
    if shuffle:
        ids = ids[torch.randperm(len(ids))]
    tables, start = [], 0
    for count in counts:
        tables.append(ids[start:start + count].tolist())
        start += count
    return tables, sum(counts) + 1


def build_metadata(
    context_lens: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: str | torch.device,
    num_padding_tokens: int = 0,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for a step where sequence i has context_lens[i] tokens cached and runs
    query_lens[i] new ones; padding tokens (slot -1) go at the end. Returns (metadata,
    positions [num_tokens] int64)."""
    slots: list[int] = []
    positions: list[int] = []
    for ctx, q, table in zip(context_lens, query_lens, block_tables):
        for pos in range(ctx, ctx + q):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
    slots += [-1] * num_padding_tokens
    positions += [0] * num_padding_tokens
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    width = max(len(t) for t in block_tables)
    table = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for i, t in enumerate(block_tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)
