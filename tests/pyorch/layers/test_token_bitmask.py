"""apply_grammar_bitmask: a step's grammar rows laid over the sampler's rows, against the
pure-torch reference, on the CPU and (where there is one) CUDA: rows in any order, sampled
rows without a grammar, grammar rows of requests that do not sample this step, and the reused
staging buffer across steps of growing and shrinking size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyorch.layers.token_bitmask import apply_grammar_bitmask, apply_token_bitmask_native
from pyorch.structured_output.manager import GrammarOutput

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 111  # 4 words, the last one partial


def _expected(logits: torch.Tensor, sampled: list[str], grammar: GrammarOutput) -> torch.Tensor:
    """The reference: a full [rows, words] mask, all-ones where a row has no grammar."""
    full = np.full((logits.shape[0], grammar.grammar_bitmask.shape[1]), -1, dtype=np.int32)
    rows = []
    for j, req_id in enumerate(grammar.structured_output_request_ids):
        if req_id in sampled:
            full[sampled.index(req_id)] = grammar.grammar_bitmask[j]
            rows.append(sampled.index(req_id))
    out = logits.clone()
    apply_token_bitmask_native(out, torch.from_numpy(full).to(logits.device),
                               torch.tensor(rows, dtype=torch.int32, device=logits.device))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference_across_steps(device: str):
    rng = np.random.default_rng(0)
    num_words = (VOCAB + 31) // 32
    cases = [
        (["a", "b", "c"], ["a", "b", "c"]),  # every row, in order (the common decode step)
        (["a", "b", "c", "d", "e"], ["d", "b"]),  # a subset, out of order
        (["a", "b"], ["b", "x", "a"]),  # "x" has a grammar but does not sample this step
        (["a"] * 1 + [f"r{i}" for i in range(40)], [f"r{i}" for i in range(0, 40, 3)]),
        (["a", "b", "c", "d"], ["a"]),  # smaller again: the staging buffer is reused
        (["a", "b"], ["x"]),  # nothing to mask
    ]
    for sampled, constrained in cases:
        bitmask = rng.integers(-2**31, 2**31 - 1, size=(len(constrained), num_words),
                               dtype=np.int32)
        bitmask[:, 1] = 0  # whole words of forbidden tokens
        grammar = GrammarOutput(constrained, bitmask)
        logits = torch.randn(len(sampled), VOCAB, device=device)
        want = _expected(logits, sampled, grammar)
        apply_grammar_bitmask(logits, sampled, grammar)
        torch.testing.assert_close(logits, want, rtol=0, atol=0)


def test_wrong_width_raises():
    grammar = GrammarOutput(["a"], np.zeros((1, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="2 words per row for 111 logits"):
        apply_grammar_bitmask(torch.zeros(1, VOCAB), ["a"], grammar)
