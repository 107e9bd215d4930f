"""Beam search (pyorch/beam_search.py, `LLM.beam_search`) against a brute-force reference.

The reference recomputes each beam from scratch with transformers (full log-softmax over the
vocabulary, fp32, no KV cache) and extends it by its 2 * beam_width most likely tokens, vLLM's
candidate rule (an EOS ending ranked lower is not a candidate, there as here); engine and
reference must agree token for token. The tiny model's EOS is set to a token the search meets,
so completed beams and the length penalty's EOS rule are exercised too.
"""

from __future__ import annotations

import json

import pytest
import torch

from pyorch import LLM, BeamSearchParams
from pyorch.beam_search import BeamSearchState, get_beam_search_score
from pyorch.outputs import Logprob
from tests.pyorch.entrypoints.test_llm import _tiny_config

transformers = pytest.importorskip("transformers")


def _log_softmax_last(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)


def _reference(model, prompt: list[int], width: int, max_tokens: int, eos: int,
               length_penalty: float) -> list[tuple[list[int], float]]:
    """Beam search with candidates from the whole vocabulary's ranking: (tokens incl. prompt,
    cumulative logprob), best first. Scores: cum / len ** length_penalty, a final EOS not
    counted (vLLM, transformers)."""
    def score(item: tuple[list[int], float]) -> float:
        tokens, cum = item
        n = len(tokens) - (tokens[-1] == eos)
        return cum / n ** length_penalty

    beams: list[tuple[list[int], float]] = [(prompt, 0.0)]
    completed: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        if not beams:
            break
        candidates = []
        for tokens, cum in beams:
            row = _log_softmax_last(model, tokens)
            for token_id in row.topk(2 * width).indices.tolist():
                new = (tokens + [token_id], cum + row[token_id].item())
                (completed if token_id == eos else candidates).append(new)
        beams = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(completed + beams, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def beam_model(tmp_path_factory):
    """A tiny Llama whose EOS is the 2nd token of the prompt's best continuation, so beams end."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_tiny_config("llama"),
                                                          torch_dtype=torch.float32).eval()
    prompt = [5, 17, 99, 230, 7]
    first = int(_log_softmax_last(model, prompt).argmax())
    eos = int(_log_softmax_last(model, prompt + [first]).topk(2).indices[1])
    model.config.eos_token_id = eos
    path = tmp_path_factory.mktemp("beam_llama")
    model.save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    assert config["eos_token_id"] == eos
    llm = LLM(str(path), skip_tokenizer_init=True, dtype=torch.float32, max_model_len=128,
              seed=0, kv_cache_memory_bytes=32 << 20, device="cpu")
    return llm, model, prompt, eos


@pytest.mark.parametrize("width,max_tokens,length_penalty",
                         [(1, 4, 1.0), (3, 4, 1.0), (4, 5, 0.3), (3, 4, 2.0)])
def test_beam_search_matches_brute_force(beam_model, width, max_tokens, length_penalty):
    llm, model, prompt, eos = beam_model
    other = [9, 300, 41]
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                              length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": prompt}, {"prompt_token_ids": other}], params)
    assert len(outs) == 2
    for out, p in zip(outs, [prompt, other], strict=True):
        want = _reference(model, p, width, max_tokens, eos, length_penalty)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        for seq, (_, cum) in zip(out.sequences, want, strict=True):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert len(seq.logprobs) == len(seq.tokens) - len(p)
            assert seq.finish_reason == ("stop" if seq.tokens[-1] == eos else "length")
    sched = llm.llm_engine.scheduler
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_usable_blocks


def test_beam_search_reaches_eos(beam_model):
    """With width 2 the EOS found at step 2 is among the results (the fixture's construction)."""
    llm, _, prompt, eos = beam_model
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=6))[0]
    assert any(s.tokens[-1] == eos and s.finish_reason == "stop" for s in out.sequences)
    ignoring = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=6,
                                                          ignore_eos=True))[0]
    assert all(len(s.tokens) == len(prompt) + 6 for s in ignoring.sequences)


def test_concurrency_limit_gives_the_same_results(beam_model):
    llm, _, prompt, _ = beam_model
    prompts = [prompt, [3, 4, 5], [200, 201]]
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    together = llm.beam_search(prompts, params)
    one_by_one = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in together] == \
        [[s.tokens for s in o.sequences] for o in one_by_one]


def test_bad_beam_search_params_raise(beam_model):
    llm, _, prompt, _ = beam_model
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=2)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        BeamSearchParams(beam_width=2, max_tokens=2, include_stop_str_in_output=True)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=125))


def test_score_discounts_a_final_eos_and_applies_the_length_penalty():
    assert get_beam_search_score([1, 2, 3, 9], -6.0, eos_token_id=9) == pytest.approx(-2.0)
    assert get_beam_search_score([1, 2, 3, 4], -6.0, eos_token_id=9) == pytest.approx(-1.5)
    assert get_beam_search_score([1, 2, 3, 4], -6.0, 9, length_penalty=0.5) == pytest.approx(-3.0)
    # Extreme penalties (any JSON float reaches the server) give a score, never an exception.
    assert get_beam_search_score([1, 2, 3], -3.0, None, 1e308) == 0.0
    assert get_beam_search_score([1, 2, 3], -3.0, None, -1e308) == float("-inf")


def test_state_keeps_the_best_and_moves_eos_beams_to_completed():
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    state = BeamSearchState([[1]], params, eos_token_id=0)
    state.advance([{0: Logprob(-0.1), 5: Logprob(-0.5), 6: Logprob(-0.7), 7: Logprob(-3.0)}])
    assert [b.tokens for b in state.live_beams()] == [[1, 5], [1, 6]]
    assert [b.tokens for b in state.completed[0]] == [[1, 0]]
    state.advance([{8: Logprob(-0.2)}, {9: Logprob(-5.0)}])
    assert state.done
    best = state.outputs()[0]
    # [1, 0]: -0.1 / 1; [1, 5, 8]: -0.7 / 3; [1, 6, 9]: -5.7 / 3
    assert [b.tokens for b in best] == [[1, 0], [1, 5, 8]]
    assert [b.finish_reason for b in best] == ["stop", "length"]
