"""CUDA graphs of the model's forward pass, one per padded batch size, sharing one memory pool.

A step of `n` scheduled tokens over `s` sequences (decode, or a small mixed batch) replays the
graph captured for the smallest size `T >= n`. The graph reads its inputs from fixed places in the
model runner's device step buffer (the layout for T tokens, min(T, max_num_seqs) sequences and
the full block-table width), so the step's single host-to-device copy is also the graph's input
update. The padding is inert: padded tokens write no KV (slot -1) and belong to no sequence
(query_start_loc stays at n), padded sequences have no query rows and seq_len 0.

What the attention op decides on the host (the number of KV splits, the grid, which kernels run)
is baked in at capture from pessimistic values: max_seq_len = max_model_len, and max_query_len = T
for a mixed graph. The kernel takes each sequence's real range from device data, so any batch that
fits is computed exactly; only the host-side choices see the capture-time values.

Two kinds of graph, as vLLM's full-and-piecewise mode separates them: a decode graph (one token
per sequence, max_query_len = 1) launches only the decode attention kernel, while a mixed graph
also launches the prefill kernel's grid for the rows that could be prompt tokens; at batch 1000
that empty grid alone cost 1 ms a step on an H100. Decode graphs are captured at every size up to
max_num_seqs, mixed graphs at every size of the list (the default list stops the mixed ones at
min(256, 2 * max_num_seqs): larger mixed batches are prefill-heavy and gain little).
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
# Mixed batches past this many tokens are prefill-heavy (milliseconds of GPU work a step): they
# run eagerly, and start-up captures 16 fewer graphs.
_MAX_DEFAULT_MIXED = 256


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """1, 2, 4, multiples of 8 up to 256, then multiples of 16 (vLLM's list), up to
    min(512, 2 * max_num_seqs) for small mixed batches, and further up to max_num_seqs so that
    every decode-only batch replays a graph, in multiples of 32 past 512; never past the token
    budget. cuBLAS picks slower kernels for Llama-3-8B's MLP GEMMs at 1,000-1,008 rows than at
    992 or 1,024 (H100: gate_up 375 us at 1,008, 346 at 1,024; down 212 against 200;
    bench/probes/gemm_large_m.py), so a batch of 1,000 pads to 1,024."""
    limit = max(min(_MAX_DEFAULT_CAPTURE, 2 * max_num_seqs), max_num_seqs)
    limit = max(1, min(limit, max_num_batched_tokens))
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, min(limit, 256) + 1, 8))
    sizes += list(range(272, min(limit, _MAX_DEFAULT_CAPTURE) + 1, 16))
    sizes += list(range(_MAX_DEFAULT_CAPTURE + 32, limit + 1, 32))
    if sizes[-1] < limit:  # the largest batch itself, so it never runs eagerly
        sizes.append(limit)
    return sizes


def default_max_mixed_size(max_num_seqs: int) -> int:
    """The largest mixed-batch graph of the default list (decode graphs go on to max_num_seqs)."""
    return min(_MAX_DEFAULT_MIXED, 2 * max_num_seqs)


def normalize_capture_sizes(sizes: Sequence[int], max_num_batched_tokens: int) -> list[int]:
    bad = [s for s in sizes if not isinstance(s, int) or s < 1]
    if bad:
        raise ValueError(f"cuda_graph_sizes must be positive integers, got {bad}")
    return sorted({s for s in sizes if s <= max_num_batched_tokens})


def graph_pool_bytes(pool: tuple, device: torch.device) -> int:
    """Bytes the caching allocator holds in `pool` (a graph_pool_handle()) on `device`: the
    sizes of the segments it took from cudaMalloc for that pool."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == tuple(pool)
               and seg.get("device", index) == index)


@dataclass
class _Graph:
    size: int  # padded number of tokens
    decode: bool  # captured with max_query_len 1 (a decode-only batch)
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
                 max_model_len: int, device: torch.device, max_mixed_size: Optional[int] = None):
        self.model = model
        self.sizes = sorted(sizes)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.device = device
        limit = self.max_size if max_mixed_size is None else max_mixed_size
        self.mixed_sizes = [s for s in self.sizes if s <= limit]
        self.decode_sizes = [s for s in self.sizes if s <= max_num_seqs]
        self.graphs: dict[int, _Graph] = {}  # mixed graphs by size
        self.decode_graphs: dict[int, _Graph] = {}
        # The graphs' memory pool (a torch.cuda.graph_pool_handle()), set by capture().
        self.pool: tuple[int, int] | None = None
        self.capture_seconds = 0.0
        self.memory_bytes = 0
        self.pool_bytes = 0
        self.num_replays = 0
        self.num_decode_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    @property
    def num_graphs(self) -> int:
        shared = sum(1 for s, g in self.decode_graphs.items() if self.graphs.get(s) is g)
        return len(self.graphs) + len(self.decode_graphs) - shared

    def padded_size(self, num_tokens: int, decode_only: bool = False) -> Optional[int]:
        """The captured size a step of num_tokens replays, or None (run it eagerly). A
        decode-only step (one token per sequence) takes a decode graph where one fits."""
        if decode_only:
            for size in self.decode_sizes:
                if size >= num_tokens:
                    return size if size in self.decode_graphs else None
        for size in self.mixed_sizes:
            if size >= num_tokens:
                return size if size in self.graphs else None
        return None

    def graph_for(self, size: int, decode_only: bool) -> _Graph:
        """The graph padded_size(n, decode_only) chose for this size."""
        return (self.decode_graphs if decode_only and size in self.decode_graphs
                else self.graphs)[size]

    def num_seqs_for(self, size: int) -> int:
        return min(size, self.max_num_seqs)

    @torch.inference_mode()
    def capture(self, inputs_for: Callable[[int, int], dict[str, torch.Tensor]]) -> None:
        """Captures every size, largest first, so smaller graphs reuse the pool's blocks."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self.pool = pool
        stream = torch.cuda.Stream(self.device)
        # Largest first over both kinds: the pool's blocks are reused by everything after.
        # Size 1 is one decode token either way: its mixed graph is also the decode graph.
        decode_keys = [(s, True) for s in self.decode_sizes if s != 1 or 1 not in self.mixed_sizes]
        order = sorted([(s, False) for s in self.mixed_sizes] + decode_keys,
                       key=lambda k: (-k[0], k[1]))
        for size, decode in order:
            num_seqs = self.num_seqs_for(size)
            inputs = inputs_for(size, num_seqs)
            self._fill_dummy(inputs, size, num_seqs)
            meta = self._metadata(inputs, num_seqs, 1 if decode else size)
            # One eager run first: lazy initialisation (cuBLAS handles, workspaces, kernel
            # modules) must not happen inside the capture.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), set_forward_context(meta):
                self.model(inputs["input_ids"], inputs["positions"])
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with set_forward_context(meta), torch.cuda.graph(graph, pool=pool):
                hidden = self.model(inputs["input_ids"], inputs["positions"])
            (self.decode_graphs if decode else self.graphs)[size] = _Graph(
                size, decode, num_seqs, graph, hidden)
        if 1 in self.decode_sizes and 1 not in self.decode_graphs:
            self.decode_graphs[1] = self.graphs[1]
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        # The pool's segments are the graphs' memory. The drop in free device memory is kept
        # beside it (it would add the driver's own graph objects) but does not measure the pool:
        # it read 0.000 GiB on an H100 while the pool held 0.275 GiB.
        self.pool_bytes = graph_pool_bytes(pool, self.device)
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info("Captured %d CUDA graphs (%d decode, %d mixed; sizes %d..%d) in %.2f s: "
                    "graph memory pool %.3f GiB, free device memory %.3f GiB lower",
                    self.num_graphs, len(self.decode_graphs), len(self.graphs), self.sizes[0],
                    self.sizes[-1], self.capture_seconds, self.pool_bytes / 2**30,
                    self.memory_bytes / 2**30)

    def replay(self, size: int, decode_only: bool = False) -> torch.Tensor:
        """Replays the graph padded_size(n, decode_only) chose (its inputs already in place);
        returns its hidden states."""
        entry = self.graph_for(size, decode_only)
        entry.graph.replay()
        self.num_replays += 1
        self.num_decode_replays += entry.decode
        return entry.hidden

    def _metadata(self, inputs: dict[str, torch.Tensor], num_seqs: int,
                  max_query_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=inputs["slot_mapping"], query_start_loc=inputs["query_start_loc"],
            seq_lens=inputs["seq_lens"], block_table=inputs["block_table"],
            max_query_len=max_query_len, max_seq_len=self.max_model_len,
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
