"""LogprobsProcessor: sampler rows -> list[dict[int, Logprob]], cumulative logprob."""

import math

import torch

from pyorch.core_types import LogprobsLists
from pyorch.engine.logprobs import LogprobsProcessor
from pyorch.layers.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    compute_prompt_logprobs,
)
from pyorch.outputs import Logprob
from pyorch.sampling_params import SamplingParams


class _CharTokenizer:
    def decode(self, token_ids, **kwargs):
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


def test_sample_logprobs_per_request_width():
    logits = torch.randn(2, 30)
    params = [SamplingParams(logprobs=2, temperature=0.0), SamplingParams(logprobs=5)]
    rows = [SamplingRow(p, [], []) for p in params]
    out = Sampler()(logits, SamplingMetadata.from_requests(rows, 30, "cpu"))
    lists = out.logprobs.tolists()
    ref = torch.log_softmax(logits, -1)
    processors = [LogprobsProcessor.from_params(_CharTokenizer(), p) for p in params]
    for i, proc in enumerate(processors):
        proc.update_from_output(lists.slice(i, i + 1))
    # Greedy row: the sampled token is the top-1, so the dict has 2 entries (not 3).
    first = processors[0].logprobs[0]
    top = ref[0].topk(2)
    assert list(first) == top.indices.tolist()
    assert first[top.indices[0].item()].rank == 1 and first[top.indices[1].item()].rank == 2
    assert math.isclose(first[top.indices[1].item()].logprob, top.values[1].item(), rel_tol=1e-6)
    assert first[top.indices[0].item()].decoded_token == chr(ord("a") + top.indices[0].item() % 26)
    # Random row: 5 top entries plus the sampled token (which may be one of them).
    second = processors[1].logprobs[0]
    sampled = out.sampled_token_ids[1].item()
    assert sampled in second and 5 <= len(second) <= 6
    assert second[sampled].rank == (ref[1] > ref[1, sampled]).sum().item() + 1
    assert math.isclose(processors[1].cumulative_logprob, ref[1, sampled].item(), rel_tol=1e-6)


def test_cumulative_logprob_accumulates_and_none_when_off():
    proc = LogprobsProcessor(None, num_logprobs=0, num_prompt_logprobs=None)
    proc.update_from_output(LogprobsLists([[4]], [[-0.5]], [3]))
    proc.update_from_output(LogprobsLists([[7]], [[-1.25]], [1]))
    assert proc.cumulative_logprob == -1.75
    assert proc.logprobs == [{4: Logprob(-0.5, 3, None)}, {7: Logprob(-1.25, 1, None)}]
    off = LogprobsProcessor(None, None, None)
    off.update_from_output(LogprobsLists([[4]], [[-0.5]], [3]))
    assert off.logprobs is None and off.cumulative_logprob is None and off.prompt_logprobs is None


def test_prompt_logprobs_chunks():
    prompt = [3, 9, 1, 4, 4, 0]
    logits = torch.randn(len(prompt), 12)  # position i predicts token i + 1
    proc = LogprobsProcessor(_CharTokenizer(), None, num_prompt_logprobs=1)
    for start, end in [(0, 3), (3, 6)]:  # two prefill chunks
        stop = min(end, len(prompt) - 1)
        lists = compute_prompt_logprobs(
            logits[start:stop], torch.tensor(prompt[start + 1 : stop + 1]), 1).tolists()
        proc.update_from_output(new_prompt_logprobs=lists)
    entries = proc.pop_prompt_logprobs()
    assert entries[0] is None and len(entries) == len(prompt)
    ref = torch.log_softmax(logits, -1)
    for pos in range(1, len(prompt)):
        token = prompt[pos]
        assert token in entries[pos]
        assert math.isclose(entries[pos][token].logprob, ref[pos - 1, token].item(), rel_tol=1e-6)
        assert len(entries[pos]) in (1, 2)
    assert proc.pop_prompt_logprobs() == []
