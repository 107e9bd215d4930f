"""CUDA graphs of the model's forward pass, one per padded batch size, sharing one memory pool.

A step of `n` scheduled tokens over `s` sequences (decode, or a small mixed batch) replays the
graph captured for the smallest size `T >= n`. The graph reads its inputs from fixed places in the
model runner's device step buffer (the layout for T tokens, min(T, max_num_seqs) sequences and
the full block-table width), so the step's single host-to-device copy is also the graph's input
update. The padding is inert: padded tokens write no KV (slot -1) and belong to no sequence
(query_start_loc stays at n), padded sequences have no query rows and seq_len 0.

What the attention op decides on the host (the number of KV splits, the grid) is baked in at
capture from pessimistic values: max_query_len = T and max_seq_len = max_model_len. The kernel
takes each sequence's real range from device data, so any batch that fits is computed exactly;
only the split heuristic sees the capture-time values.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from pyorch.forward_context import AttentionMetadata, set_forward_context

logger = logging.getLogger(__name__)

_MAX_DEFAULT_CAPTURE = 512


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """1, 2, 4, multiples of 8 up to 256, then multiples of 16 (vLLM's list), up to
    min(512, 2 * max_num_seqs) for small mixed batches, and further up to max_num_seqs so that
    every decode-only batch replays a graph; never past the token budget."""
    limit = max(min(_MAX_DEFAULT_CAPTURE, 2 * max_num_seqs), max_num_seqs)
    limit = max(1, min(limit, max_num_batched_tokens))
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, min(limit, 256) + 1, 8))
    sizes += list(range(272, limit + 1, 16))
    if sizes[-1] < limit:  # the largest batch itself, so it never runs eagerly
        sizes.append(limit)
    return sizes


def normalize_capture_sizes(sizes: Sequence[int], max_num_batched_tokens: int) -> list[int]:
    bad = [s for s in sizes if not isinstance(s, int) or s < 1]
    if bad:
        raise ValueError(f"cuda_graph_sizes must be positive integers, got {bad}")
    return sorted({s for s in sizes if s <= max_num_batched_tokens})


@dataclass
class _Graph:
    size: int  # padded number of tokens
    num_seqs: int  # padded number of sequences
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, hidden_size], written by every replay


class CUDAGraphRunner:
    """Captures and replays the forward pass `model(input_ids, positions)` at fixed sizes.

    `inputs_for(size, num_seqs)` must return the device tensors a step of that padded size reads
    (input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_table), at the same
    addresses every time it is called with the same arguments.
    """

    def __init__(self, model: Callable[..., torch.Tensor], sizes: Sequence[int], max_num_seqs: int,
                 max_model_len: int, device: torch.device):
        self.model = model
        self.sizes = sorted(sizes)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.device = device
        self.graphs: dict[int, _Graph] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.memory_bytes = 0
        self.num_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def padded_size(self, num_tokens: int) -> Optional[int]:
        """The captured size a step of num_tokens replays, or None (run it eagerly)."""
        for size in self.sizes:
            if size >= num_tokens:
                return size if size in self.graphs else None
        return None

    def num_seqs_for(self, size: int) -> int:
        return min(size, self.max_num_seqs)

    @torch.inference_mode()
    def capture(self, inputs_for: Callable[[int, int], dict[str, torch.Tensor]]) -> None:
        """Captures every size, largest first, so smaller graphs reuse the pool's blocks."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            num_seqs = self.num_seqs_for(size)
            inputs = inputs_for(size, num_seqs)
            self._fill_dummy(inputs, size, num_seqs)
            meta = self._metadata(inputs, num_seqs, size)
            # One eager run first: lazy initialisation (cuBLAS handles, workspaces) must not
            # happen inside the capture.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), set_forward_context(meta):
                self.model(inputs["input_ids"], inputs["positions"])
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with set_forward_context(meta), torch.cuda.graph(graph, pool=self.pool):
                hidden = self.model(inputs["input_ids"], inputs["positions"])
            self.graphs[size] = _Graph(size, num_seqs, graph, hidden)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info("Captured %d CUDA graphs (sizes %d..%d) in %.2f s, using %.2f GiB",
                    len(self.graphs), self.sizes[0], self.sizes[-1], self.capture_seconds,
                    self.memory_bytes / 2**30)

    def replay(self, size: int) -> torch.Tensor:
        """Replays the graph of `size` (its inputs already in place); returns its hidden states."""
        entry = self.graphs[size]
        entry.graph.replay()
        self.num_replays += 1
        return entry.hidden

    def _metadata(self, inputs: dict[str, torch.Tensor], num_seqs: int,
                  size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=inputs["slot_mapping"], query_start_loc=inputs["query_start_loc"],
            seq_lens=inputs["seq_lens"], block_table=inputs["block_table"],
            max_query_len=size, max_seq_len=self.max_model_len,
        )

    @staticmethod
    def _fill_dummy(inputs: dict[str, torch.Tensor], size: int, num_seqs: int) -> None:
        """A valid batch for the warm-up run and the capture: one token per sequence, the last
        taking the rest, every KV read from the null block and no KV written."""
        inputs["input_ids"].zero_()
        inputs["positions"].zero_()
        inputs["slot_mapping"].fill_(-1)
        qsl = inputs["query_start_loc"]
        qsl.copy_(torch.arange(num_seqs + 1, dtype=qsl.dtype, device=qsl.device))
        qsl[-1] = size
        seq_lens = inputs["seq_lens"]
        seq_lens.fill_(1)
        seq_lens[-1] = size - num_seqs + 1
        inputs["block_table"].zero_()
