"""The runner's per-step inputs: BlockTable rows, and the packed step buffer built by
ModelRunner._prepare_inputs (vectorized) against a plain per-token reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyorch.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pyorch.executor.input_batch import BlockTable, StepBuffers
from pyorch.sampling_params import SamplingParams


def test_block_table_rows_grow_and_are_zeroed_on_release():
    table = BlockTable(2, 5)
    a, b = table.acquire(), table.acquire()
    assert {a, b} == {0, 1}
    table.append(a, 0, [7, 8])
    table.append(a, 2, [9])
    table.append(b, 0, [3])
    c = table.acquire()  # beyond the initial rows: the table grows, rows keep their contents
    assert c == 2 and table.table.shape == (4, 5)
    assert table.table[a].tolist() == [7, 8, 9, 0, 0] and table.table[b].tolist() == [3, 0, 0, 0, 0]
    table.release(a, 3)
    assert table.table[a].tolist() == [0] * 5
    assert table.acquire() == a  # recycled


class _Runner:
    """The state _prepare_inputs reads, without a model."""

    from pyorch.executor.model_runner import ModelRunner as _MR

    _prepare_inputs = _MR._prepare_inputs
    _gather_input_ids = _MR._gather_input_ids
    _update_states = _MR._update_states

    def __init__(self, block_size: int, max_tokens: int, max_seqs: int, max_blocks: int):
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks
        self.requests = {}
        self.block_table = BlockTable(max_seqs, max_blocks)
        self.buffers = StepBuffers(max_tokens, max_seqs, max_blocks, "cpu")
        self.device = torch.device("cpu")
        self.cuda_graphs = None
        self._last_step = None
        self._pooling = {}  # no pooling requests (ModelRunner's per-request pooling states)
        self._cascade_ok = False  # tests/pyorch/executor/test_cascade.py turns it on
        self._kv_bytes_per_token = 0
        self._cascade_graph_kv_bytes = 0


def _new(req_id, prompt, blocks, computed=0, outputs=()):
    return NewRequestData(req_id=req_id, prompt_token_ids=list(prompt),
                          output_token_ids=list(outputs), sampling_params=SamplingParams(),
                          block_ids=list(blocks), num_computed_tokens=computed)


def test_prepare_inputs_matches_per_token_reference():
    rng = np.random.default_rng(0)
    bs = 4
    runner = _Runner(bs, max_tokens=64, max_seqs=8, max_blocks=16)
    # A chunk of a long prompt over a cached prefix, a whole short prompt, and a decode.
    specs = {"a": (30, 8, 13), "b": (5, 0, 5), "c": (9, 0, 9)}
    new_reqs = []
    for req_id, (length, computed, _) in specs.items():
        blocks = rng.permutation(np.arange(1, 40))[: -(-length // bs) + 1].tolist()
        new_reqs.append(_new(req_id, rng.integers(3, 500, length).tolist(), blocks, computed))
    runner._update_states(SchedulerOutput(new_reqs, CachedRequestData.make_empty(), {}, 0, set()))
    # Step 1: "c" computed whole, so next it decodes its first sampled token.
    sched = {r: n for r, (_, _, n) in specs.items()}
    so = SchedulerOutput([], CachedRequestData.make_empty(), sched, sum(sched.values()), set())
    req_ids = list(specs)
    dev, meta, logits_idx, sampled_rows = runner._prepare_inputs(req_ids, so)

    want_ids, want_pos, want_slots, offset, want_logits = [], [], [], 0, []
    for i, r in enumerate(req_ids):
        st = runner.requests[r]
        start, n = st.num_computed_tokens, sched[r]
        for p in range(start, start + n):
            want_ids.append(int(st.token_ids[p]))
            want_pos.append(p)
            want_slots.append(st.block_ids[p // bs] * bs + p % bs)
        offset += n
        if start + n == st.num_tokens:
            want_logits.append(offset - 1)
        assert dev["block_table"].view(3, -1)[i, : len(st.block_ids)].tolist() == st.block_ids
        assert meta.seq_lens[i].item() == start + n
    assert dev["input_ids"].tolist() == want_ids
    assert dev["positions"].tolist() == want_pos
    assert dev["slot_mapping"].tolist() == want_slots
    assert logits_idx.tolist() == want_logits and sampled_rows == [1, 2]
    assert meta.query_start_loc.tolist() == [0, 13, 18, 27]
    assert meta.max_query_len == 13 and meta.max_seq_len == 21


def test_pending_token_without_a_previous_step_raises():
    runner = _Runner(4, max_tokens=16, max_seqs=2, max_blocks=4)
    new = _new("x", [5, 6, 7], [1], computed=3)
    runner._update_states(SchedulerOutput([new], CachedRequestData.make_empty(), {}, 0, set()))
    runner.requests["x"].num_pending = 1  # a token in flight that no launched step produced
    so = SchedulerOutput([], CachedRequestData.make_empty(), {"x": 1}, 1, set())
    with pytest.raises(RuntimeError, match="not known to the runner"):
        runner._prepare_inputs(["x"], so)
