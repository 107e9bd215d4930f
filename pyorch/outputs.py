"""User-facing outputs of generation (vLLM's `RequestOutput`, `CompletionOutput`, `Logprob`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log probability of one token at one position.

    rank: 1-based rank of the token in the (raw) distribution at that position.
    decoded_token: the token's text, or None when the output is not detokenized.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled / actual token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# The first prompt token has no logprob, so its entry is None.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One output sequence of a request.

    index: the sequence's index among the request's n outputs.
    text: the generated text (a delta when streaming with delta outputs).
    token_ids: the generated token ids.
    cumulative_logprob: the sum of the sampled tokens' logprobs; None unless logprobs were asked.
    logprobs: per position, the top logprobs; None unless logprobs were asked.
    finish_reason: "stop", "length" or "abort"; None while the sequence runs.
    stop_reason: the stop string or stop token id that ended the sequence; None for EOS or
        other reasons.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.time() seconds) and durations of a request's life, vLLM's names."""

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    scheduler_time: float | None = None
    model_forward_time: float | None = None
    model_execute_time: float | None = None


@dataclass
class RequestOutput:
    """The output of one request: the prompt and its n completions so far.

    prompt_logprobs: per prompt position, the logprobs (first entry None); None unless asked.
    num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict | None = field(default=None, repr=False)

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one.

        aggregate=True appends delta completions (text, token ids, logprobs) to the ones held;
        aggregate=False replaces them. Completions are matched by `index`.
        """
        self.finished |= next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        if next_output.metrics is not None:
            self.metrics = next_output.metrics
        for next_completion in next_output.outputs:
            for i, completion in enumerate(self.outputs):
                if completion.index != next_completion.index:
                    continue
                if aggregate:
                    completion.text += next_completion.text
                    completion.token_ids = completion.token_ids + next_completion.token_ids
                    if next_completion.logprobs:
                        completion.logprobs = (completion.logprobs or []) + next_completion.logprobs
                    completion.cumulative_logprob = next_completion.cumulative_logprob
                    completion.finish_reason = next_completion.finish_reason
                    completion.stop_reason = next_completion.stop_reason
                else:
                    self.outputs[i] = next_completion
                break
            else:
                self.outputs.append(next_completion)
        self.outputs.sort(key=lambda c: c.index)
