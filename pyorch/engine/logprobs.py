"""Turns the sampler's logprob rows into the user-facing `list[dict[int, Logprob]]` form.

One `LogprobsProcessor` per output sequence lives in the output processor. Each step it receives
the request's rows of the sampler's `LogprobsLists` (one row per sampled token) and, while the
prompt runs, the rows of `compute_prompt_logprobs` for the prompt chunk.
"""

from __future__ import annotations

from typing import Any

from pyorch.core_types import LogprobsLists
from pyorch.outputs import Logprob, PromptLogprobs, SampleLogprobs
from pyorch.sampling_params import SamplingParams


def decode_token_ids(tokenizer: Any | None, token_ids: list[int]) -> list[str | None]:
    """Each id's own text (as vLLM shows it in logprobs); None without a tokenizer."""
    if tokenizer is None:
        return [None] * len(token_ids)
    return [tokenizer.decode([token_id]) for token_id in token_ids]


class LogprobsProcessor:
    """Accumulates one sequence's sample logprobs, prompt logprobs and cumulative logprob.

    Parameters
    ----------
    tokenizer: for `Logprob.decoded_token`; None leaves decoded tokens None.
    num_logprobs: SamplingParams.logprobs (None = off, -1 = whole vocab).
    num_prompt_logprobs: SamplingParams.prompt_logprobs (None = off, -1 = whole vocab).
    """

    def __init__(
        self, tokenizer: Any | None, num_logprobs: int | None, num_prompt_logprobs: int | None
    ) -> None:
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.logprobs: SampleLogprobs | None = None if num_logprobs is None else []
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0
        # The first prompt token has no logprob: its entry is None, as in vLLM.
        self.prompt_logprobs: PromptLogprobs | None = (
            None if num_prompt_logprobs is None else [None]
        )
        self._num_prompt_entries_sent = 0

    @classmethod
    def from_params(cls, tokenizer: Any | None, params: SamplingParams) -> LogprobsProcessor:
        tok = tokenizer if params.detokenize else None
        return cls(tok, params.logprobs, params.prompt_logprobs)

    def _entries(self, lists: LogprobsLists, num: int) -> list[dict[int, Logprob]]:
        entries = []
        # Column 0 is the chosen token with its own rank; columns 1.. are ranks 1, 2, ...
        width = None if num == -1 else num + 1
        for token_ids, logprobs, rank in zip(
            lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks, strict=True
        ):
            token_ids, logprobs = token_ids[:width], logprobs[:width]
            decoded = decode_token_ids(self.tokenizer, token_ids)
            ranks = [rank, *range(1, len(token_ids))]
            columns = zip(token_ids, logprobs, ranks, decoded, strict=True)
            entries.append({t: Logprob(lp, r, text) for t, lp, r, text in columns})
        return entries

    def update_from_output(
        self,
        new_logprobs: LogprobsLists | None = None,
        new_prompt_logprobs: LogprobsLists | None = None,
    ) -> None:
        """Append one step's rows: sampled-token rows and/or prompt-position rows."""
        if new_logprobs is not None and self.num_logprobs is not None:
            assert self.logprobs is not None and self.cumulative_logprob is not None
            self.logprobs.extend(self._entries(new_logprobs, self.num_logprobs))
            self.cumulative_logprob += sum(row[0] for row in new_logprobs.logprobs)
        if new_prompt_logprobs is not None and self.num_prompt_logprobs is not None:
            assert self.prompt_logprobs is not None
            self.prompt_logprobs.extend(
                self._entries(new_prompt_logprobs, self.num_prompt_logprobs)
            )

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """Prompt logprobs not handed out yet (for delta outputs)."""
        if self.prompt_logprobs is None:
            return None
        start = self._num_prompt_entries_sent
        self._num_prompt_entries_sent = len(self.prompt_logprobs)
        return self.prompt_logprobs[start:]
