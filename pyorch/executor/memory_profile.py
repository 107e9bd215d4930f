"""The start-up memory profile: the activation peak of the largest batch, from which the KV
cache is sized on a GPU (kv_cache.gpu_kv_budget_bytes)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from pyorch.forward_context import AttentionMetadata, set_forward_context
from pyorch.layers.sampler import SamplingRow, sample_rows
from pyorch.sampling_params import SamplingParams
from pyorch.utils import cdiv

if TYPE_CHECKING:
    from pyorch.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@torch.inference_mode()
def profile_activation_peak(runner: ModelRunner) -> int:
    """Runs the largest batch (max_num_batched_tokens tokens over max_num_seqs sequences)
    through the runner's model and sampler with a throwaway KV cache; returns the activation
    peak in bytes, not counting that cache."""
    spec = runner.kv_cache_spec()
    block_size, dev = runner.block_size, runner.device
    num_tokens, num_seqs = runner.max_num_tokens, min(runner.max_num_seqs, runner.max_num_tokens)
    per_seq = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    blocks_per_seq = [cdiv(n, block_size) for n in per_seq]
    temp = spec.allocate(sum(blocks_per_seq) + 1, dev)
    for layer, cache in zip(runner.attn_layers, temp, strict=True):
        layer.kv_cache = cache
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    next_block, table = 1, np.zeros((num_seqs, max(blocks_per_seq)), dtype=np.int32)
    slots = []
    for i, (n, nb) in enumerate(zip(per_seq, blocks_per_seq, strict=True)):
        table[i, :nb] = np.arange(next_block, next_block + nb)
        slots.append(next_block * block_size + np.arange(n))
        next_block += nb
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
        query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(per_seq)]),
                                     dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(per_seq, dtype=torch.int32, device=dev),
        block_table=torch.from_numpy(table).to(dev),
        max_query_len=max(per_seq), max_seq_len=max(per_seq),
    )
    input_ids = torch.randint(0, runner.vocab_size, (num_tokens,), device=dev)
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in per_seq])).to(dev)
    with set_forward_context(meta):
        hidden = runner.loaded_model(input_ids, positions)
    last = meta.query_start_loc[1:] - 1
    logits = runner.loaded_model.compute_logits(hidden[last.long()]).float()
    del hidden
    # The sampler's most memory-hungry path: top-k/top-p sorting and logprobs on every row.
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=20,
                            repetition_penalty=1.1)
    sample_rows(runner.sampler, logits,
                [SamplingRow(params, [0], [], None) for _ in range(logits.shape[0])])
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del logits, temp, meta
    for layer in runner.attn_layers:
        layer.kv_cache = None
    torch.cuda.empty_cache()
    logger.info("Profiled %d tokens / %d sequences: activation peak %.2f GiB",
                num_tokens, num_seqs, peak / 2**30)
    return peak  # `base` already counted the throwaway cache
