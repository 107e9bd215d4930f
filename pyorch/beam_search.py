"""Beam search on top of the engine (vLLM's `vllm.beam_search` and `LLM.beam_search`).

Like vLLM, beam search is not a sampler mode: every step runs each live beam as a one-token
request with `logprobs = 2 * beam_width`, extends each beam by every token of that step's
logprobs, and keeps the `beam_width` best extensions per prompt by `get_beam_search_score`.
A beam that ends in EOS (unless `ignore_eos`) moves to `completed`; after `max_tokens` steps (or
when no beam is live) the live beams join the completed ones and the best `beam_width` are
returned. The prefix cache makes the repeated prompts cheap: each step recomputes one token per
beam. `BeamSearchState` holds that bookkeeping without running anything, so the offline `LLM`
(synchronous) and the server (`AsyncLLM`) share it.

vLLM's conventions kept here: a sequence's `tokens` include the prompt, and so does the length
that `length_penalty` divides by; the candidates of a beam are its step's `2 * beam_width`
most likely tokens (plus the sampled one), which always hold the `beam_width` best extensions
that do not end in EOS; an EOS ranked below them is not a candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from pyorch.engine.input_processor import MAX_LOGPROBS
from pyorch.outputs import Logprob
from pyorch.sampling_params import RequestOutputKind, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step asks for 2 * beam_width logprobs


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`.

    beam_width: beams kept per prompt, and sequences returned per prompt (1..10 here: a step asks
        for 2 * beam_width logprobs, at most max_logprobs = 20).
    max_tokens: most tokens generated per beam.
    ignore_eos: keep extending beams past EOS.
    temperature: each step's sampling temperature. The candidates are the step's top
        2 * beam_width tokens by the model's logprobs plus the sampled token, so with
        temperature > 0 a sampled token may join them (as in vLLM); 0 keeps the search greedy.
    length_penalty: a sequence's score is cum_logprob / len(tokens) ** length_penalty.
    include_stop_str_in_output: accepted for vLLM's signature; beam search has no stop strings,
        so only its default is meaningful and anything else is refused.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or not (
                1 <= self.beam_width <= MAX_BEAM_WIDTH):
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}] (each step "
                             f"asks for 2 * beam_width logprobs, at most {MAX_LOGPROBS}), got "
                             f"{self.beam_width!r}.")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or (
                self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}.")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if self.include_stop_str_in_output:
            raise ValueError("include_stop_str_in_output is not supported with beam search "
                             "(beam search has no stop strings).")

    def step_params(self) -> SamplingParams:
        """The one-token request each live beam runs per step."""
        return SamplingParams(n=1, max_tokens=1, temperature=self.temperature,
                              logprobs=2 * self.beam_width, ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` (prompt then generated), the logprobs of each generated position,
    their sum, the decoded text (filled only when returned) and why it ended."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float,
                          eos_token_id: Optional[int], length_penalty: float = 1.0) -> float:
    """vLLM's (and transformers') score: the cumulative logprob over the length to the power of
    length_penalty; a final EOS does not count towards the length."""
    seq_len = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    try:
        denominator = float(max(seq_len, 1)) ** length_penalty
    except OverflowError:  # an extreme length_penalty: the length dominates the score
        denominator = math.inf
    if denominator == 0.0:
        return -math.inf if cumulative_logprob < 0 else 0.0
    return cumulative_logprob / denominator


class BeamSearchState:
    """The beams of every prompt of one beam-search call.

    Drive it with `live_beams()` (the sequences to run for one token) and `advance(step_logprobs)`
    (their step logprobs, in the same order) until `done`; then `outputs()`.
    """

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams,
                 eos_token_id: Optional[int]) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        self.prompt_lens = [len(p) for p in prompts]
        self.beams: list[list[BeamSearchSequence]] = [[BeamSearchSequence(list(p))]
                                                      for p in prompts]
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.num_steps = 0

    def _score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, self.eos_token_id,
                                     self.params.length_penalty)

    @property
    def done(self) -> bool:
        return self.num_steps >= self.params.max_tokens or not any(self.beams)

    def live_beams(self) -> list[BeamSearchSequence]:
        return [beam for beams in self.beams for beam in beams]

    def advance(self, step_logprobs: list[dict[int, Logprob]]) -> None:
        """Extends every live beam by each token of its step's logprobs; keeps the best."""
        it = iter(step_logprobs)
        stops_at_eos = self.eos_token_id is not None and not self.params.ignore_eos
        for i, beams in enumerate(self.beams):
            candidates = []
            for beam in beams:
                step = next(it)
                for token_id, logprob in step.items():
                    new = BeamSearchSequence(tokens=beam.tokens + [token_id],
                                             logprobs=beam.logprobs + [step],
                                             cum_logprob=beam.cum_logprob + logprob.logprob)
                    if stops_at_eos and token_id == self.eos_token_id:
                        new.finish_reason = "stop"
                        self.completed[i].append(new)
                    else:
                        candidates.append(new)
            candidates.sort(key=self._score, reverse=True)
            self.beams[i] = candidates[:self.params.beam_width]
        self.num_steps += 1

    def outputs(self) -> list[list[BeamSearchSequence]]:
        """Per prompt, the best `beam_width` of the completed and live beams, best first."""
        results = []
        for beams, completed in zip(self.beams, self.completed, strict=True):
            for beam in beams:
                beam.finish_reason = "length"
            best = sorted(completed + beams, key=self._score, reverse=True)
            results.append(best[:self.params.beam_width])
        return results

    def generated(self, prompt_idx: int, beam: BeamSearchSequence) -> list[int]:
        """The tokens a beam generated (without the prompt)."""
        return beam.tokens[self.prompt_lens[prompt_idx]:]
