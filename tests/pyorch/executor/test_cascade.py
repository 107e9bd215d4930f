"""Cascade attention's per-step plan (pyorch/executor/cascade.py) and the runner's packed inputs
for it. The attention itself is checked in tests/cuda/attention/test_paged_attention.py
(test_cascade_composition) and end to end in tests/pyorch/entrypoints/test_llm.py
(test_cascade_attention_matches)."""

from __future__ import annotations

import numpy as np
import pytest

from pyorch.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pyorch.executor import cascade
from pyorch.executor.cascade import plan_cascade
from pyorch.sampling_params import SamplingParams
from tests.pyorch.executor.test_input_batch import _Runner

BS = 16


def _table(rows: list[list[int]], width: int) -> np.ndarray:
    table = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table


def _batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Two groups (prefixes of 20 and 17 blocks, sizes 5 and 4, members interleaved), one group
    of 2 (too small), and two loners; returns (table, seq_lens, group id per row or -1)."""
    ids = iter(rng.permutation(np.arange(1, 1000)).tolist())
    prefixes = {0: [next(ids) for _ in range(20)], 1: [next(ids) for _ in range(17)],
                2: [next(ids) for _ in range(30)]}
    groups = [0, 1, 0, 2, 1, 0, -1, 1, 0, 2, 1, 0, -1]
    rows, lens = [], []
    for g in groups:
        own = [next(ids) for _ in range(int(rng.integers(1, 6)))]
        prefix = prefixes[g] if g >= 0 else [next(ids)]
        rows.append(prefix + own)
        lens.append((len(prefix) + len(own) - 1) * BS + int(rng.integers(1, BS + 1)))
    return _table(rows, 40), np.array(lens), groups


def test_plan_groups_rows_by_shared_prefix():
    table, lens, groups = _batch(np.random.default_rng(0))
    plan = plan_cascade(table, lens, BS, kv_bytes_per_token=1 << 20)
    assert plan is not None and plan.num_groups == 2
    members = [sorted(i for i, g in enumerate(groups) if g == k) for k in (0, 1)]
    qsl = plan.prefix_query_start_loc.tolist()
    got = [sorted(plan.perm[qsl[j] : qsl[j + 1]].tolist()) for j in range(2)]
    assert sorted(got) == sorted(members)
    for j, rows in enumerate(got):
        blocks = plan.prefix_seq_lens[j] // BS
        assert blocks == (20 if rows == members[0] else 17)
        assert (plan.prefix_block_table[j, :blocks] == table[rows[0], :blocks]).all()
    assert plan.max_group_size == 5
    assert plan.saved_tokens == (4 * 20 + 3 * 17) * BS
    for i in range(len(lens)):  # each row's suffix: its blocks after its group's prefix
        shift = next((plan.prefix_seq_lens[j] // BS for j, rows in enumerate(got) if i in rows), 0)
        assert plan.suffix_seq_lens[i] == lens[i] - shift * BS
        n = -(-int(plan.suffix_seq_lens[i]) // BS)
        assert (plan.suffix_block_table[i, :n] == table[i, shift : shift + n]).all()


def test_plan_prefix_stops_before_the_newest_tokens_block():
    """Rows identical in every block: the prefix still ends before the block that holds each
    row's newest token (written this step), so every suffix keeps at least that token."""
    prefix = list(range(1, 33))
    table = _table([prefix] * 6, 32)
    lens = np.array([32 * BS] * 6)
    plan = plan_cascade(table, lens, BS, kv_bytes_per_token=1 << 20)
    assert plan is not None and plan.prefix_seq_lens.tolist() == [31 * BS]
    assert plan.suffix_seq_lens.tolist() == [BS] * 6


@pytest.mark.parametrize("case", ["short_prefix", "small_groups", "few_bytes", "small_share",
                                  "short_step"])
def test_plan_declines_when_it_would_not_pay(case):
    rng = np.random.default_rng(1)
    table, lens, _ = _batch(rng)
    kv_bytes, min_step = 1 << 20, 0
    if case == "short_prefix":  # the groups' prefixes under MIN_PREFIX_TOKENS
        table[:, 15:] = rng.integers(1000, 5000, table[:, 15:].shape)
    elif case == "small_groups":
        table = table[[0, 1, 3, 6, 9, 12]]
        lens = lens[[0, 1, 3, 6, 9, 12]]
    elif case == "few_bytes":  # under MIN_SAVED_BYTES saved
        kv_bytes = cascade.MIN_SAVED_BYTES // ((4 * 20 + 3 * 17) * BS) - 1
    elif case == "small_share":  # long private suffixes: under MIN_SAVED_FRACTION of the reads
        lens = lens + 5000
    else:  # a graph step too short on the device to hide an eager step's host time
        min_step = int(lens.sum()) * kv_bytes + 1
    assert plan_cascade(table, lens, BS, kv_bytes, min_step) is None
    if case == "short_step":  # the same step without a graph to leave pays
        assert plan_cascade(table, lens, BS, kv_bytes, 0) is not None


def test_graph_threshold_scales_with_layers_and_weights():
    """Llama-3-8B's shape: 32 layers, 16 GB of weights: a graph step must read about 51 GB of KV
    (400k tokens at 128 KiB) before an eager cascade step keeps pace; more weights, less KV."""
    kv = cascade.min_graph_step_kv_bytes(32, 16 * 10**9)
    assert 40e9 < kv < 60e9
    assert cascade.min_graph_step_kv_bytes(32, 80 * 10**9) == 0
    assert cascade.min_graph_step_kv_bytes(64, 16 * 10**9) > kv


def _new(req_id: str, prompt: list[int], blocks: list[int]) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=prompt, output_token_ids=[],
                          sampling_params=SamplingParams(), block_ids=blocks,
                          num_computed_tokens=len(prompt) - 1)


def test_runner_packs_the_cascade_step(monkeypatch):
    """A decode step of 6 requests, 4 of them on one 20-block prefix: _prepare_inputs attaches
    the plan's arrays to the metadata, and the usual fields are unchanged."""
    monkeypatch.setattr(cascade, "MIN_SAVED_BYTES", 0)
    runner = _Runner(BS, max_tokens=64, max_seqs=8, max_blocks=32)
    prefix = list(range(100, 120))
    reqs = [_new(f"g{i}", [5] * (20 * BS + 3 + i), prefix + [200 + i]) for i in range(4)]
    reqs += [_new("x", [7] * 40, [300, 301, 302]), _new("y", [9] * 17, [400, 401])]
    runner._update_states(SchedulerOutput(reqs, CachedRequestData.make_empty(), {}, 0, set()))
    ids = [r.req_id for r in reqs]
    so = SchedulerOutput([], CachedRequestData.make_empty(), dict.fromkeys(ids, 1), len(ids), set())

    _, plain, _, _ = runner._prepare_inputs(ids, so)
    assert plain.cascade is None  # off in the runner
    runner._cascade_ok, runner._kv_bytes_per_token = True, 1 << 20
    _, meta, _, _ = runner._prepare_inputs(ids, so)
    c = meta.cascade
    assert c is not None
    assert meta.seq_lens.tolist() == plain.seq_lens.tolist()
    assert meta.block_table.tolist() == plain.block_table.tolist()
    assert sorted(c.perm.tolist()) == [0, 1, 2, 3]
    assert c.prefix_query_start_loc.tolist() == [0, 4] and c.prefix_max_query_len == 4
    assert c.prefix_seq_lens.tolist() == [20 * BS] and c.prefix_max_seq_len == 20 * BS
    assert c.prefix_block_table.tolist() == [prefix]
    want = [3 + i for i in range(4)] + [40, 17]
    assert c.suffix_seq_lens.tolist() == want and c.suffix_max_seq_len == 40
    assert c.suffix_block_table[:, 0].tolist() == [200, 201, 202, 203, 300, 400]
