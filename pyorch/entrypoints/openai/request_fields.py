"""vLLM's request-level extras of /v1/completions and /v1/chat/completions, in one place.

`best_of`, `use_beam_search` (+ `length_penalty`), `truncate_prompt_tokens`, `prompt_logprobs`,
`priority`, `stream_options.continuous_usage_stats`, `return_token_ids`,
`return_tokens_as_token_ids` and `usage.prompt_tokens_details`. `RequestFields.of(req, ...)`
checks them (400 naming the field) and the handlers consult the result; the rules:

- best_of: n <= best_of; best_of samples are generated and the n with the highest cumulative
  logprob are returned (best first, re-indexed); not with streaming when best_of > n.
- use_beam_search: `n` beams (`pyorch.beam_search`), `length_penalty`, `temperature`,
  `max_tokens`, `ignore_eos`; any other sampling field with a non-default value is refused,
  since beam search cannot honour it.
- truncate_prompt_tokens: keep the last k prompt tokens (-1: max_model_len); k <= max_model_len.
- prompt_logprobs: not with streaming (vLLM's rule); in the response as vLLM returns it.
- priority: needs --scheduling-policy priority unless 0 (lower runs first).
- continuous_usage_stats: needs include_usage; usage (so far, per choice) in every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncGenerator, Optional

from pyorch.beam_search import MAX_BEAM_WIDTH, BeamSearchParams, BeamSearchState
from pyorch.entrypoints.openai.errors import OpenAIError
from pyorch.entrypoints.openai.protocol import (
    PromptLogprobsJSON,
    PromptTokenUsageInfo,
    SamplingExtras,
    UsageInfo,
)
from pyorch.outputs import CompletionOutput, Logprob, RequestOutput

if TYPE_CHECKING:
    from pyorch.entrypoints.openai.serving_engine import OpenAIServing, ServerContext

# What use_beam_search can honour besides the prompt: every other sampling field must keep its
# default. (`stream`, `echo`, `user` and the chat-template fields are not sampling fields.)
_BEAM_FIELDS = {"n", "temperature", "max_tokens", "max_completion_tokens", "ignore_eos",
                "length_penalty", "use_beam_search", "priority", "truncate_prompt_tokens",
                "return_token_ids", "skip_special_tokens", "stream", "stream_options", "user",
                "model", "prompt", "messages", "echo", "add_special_tokens",
                "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                "suffix"}


@dataclass
class RequestFields:
    """The extras of one request, checked."""

    best_of: int  # samples generated per prompt (n unless best_of is given)
    beam: Optional[BeamSearchParams]
    truncate: Optional[int]  # keep this many last prompt tokens
    prompt_logprobs: Optional[int]
    continuous_usage: bool
    as_token_ids: bool
    return_token_ids: bool

    @classmethod
    def of(cls, req: SamplingExtras, ctx: ServerContext, max_tokens_field: str = "max_tokens",
           ) -> RequestFields:
        n = req.n
        best_of = n if req.best_of is None else req.best_of
        if best_of < n:
            raise OpenAIError(f"best_of must be greater than or equal to n, got n={n} and "
                              f"best_of={best_of}", param="best_of")
        if req.stream and best_of > n:
            raise OpenAIError("best_of > n is not supported with streaming", param="best_of")
        if req.prompt_logprobs is not None and req.stream:
            raise OpenAIError("prompt_logprobs are not available when stream=true",
                              param="prompt_logprobs")
        if req.priority != 0 and ctx.scheduling_policy != "priority":
            raise OpenAIError("priority is only supported with --scheduling-policy priority "
                              f"(this server schedules {ctx.scheduling_policy})", param="priority")
        truncate = req.truncate_prompt_tokens
        if truncate == 0:
            raise OpenAIError("truncate_prompt_tokens must be -1 or at least 1",
                              param="truncate_prompt_tokens")
        if truncate is not None and truncate > ctx.max_model_len:
            raise OpenAIError(f"truncate_prompt_tokens ({truncate}) is greater than "
                              f"max_model_len ({ctx.max_model_len}); use a smaller value",
                              param="truncate_prompt_tokens")
        if truncate == -1:
            truncate = ctx.max_model_len
        options = req.stream_options
        continuous = bool(options and options.continuous_usage_stats)
        if continuous and not (options and options.include_usage):
            raise OpenAIError("continuous_usage_stats needs include_usage=true",
                              param="stream_options.continuous_usage_stats")
        if req.length_penalty != 1.0 and not req.use_beam_search:
            raise OpenAIError("length_penalty is only used with use_beam_search=true",
                              param="length_penalty")
        beam = None
        if req.use_beam_search:
            beam = cls._beam_params(req)
        return cls(best_of=best_of, beam=beam, truncate=truncate,
                   prompt_logprobs=req.prompt_logprobs, continuous_usage=continuous,
                   as_token_ids=bool(req.return_tokens_as_token_ids),
                   return_token_ids=bool(req.return_token_ids))

    @staticmethod
    def _beam_params(req: SamplingExtras) -> BeamSearchParams:
        for name, info in type(req).model_fields.items():
            if name in _BEAM_FIELDS:
                continue
            value = getattr(req, name)
            if value != info.get_default(call_default_factory=True):
                raise OpenAIError(f"`{name}` is not supported with use_beam_search", param=name)
        for name in (req.model_extra or {}):  # a field _UNSUPPORTED let through as neutral
            raise OpenAIError(f"`{name}` is not supported with use_beam_search", param=name)
        if req.n > MAX_BEAM_WIDTH:
            raise OpenAIError(f"use_beam_search takes n <= {MAX_BEAM_WIDTH} beams (each step "
                              f"asks for 2 * n logprobs), got n={req.n}", param="n")
        if req.temperature is not None and req.temperature < 0:
            raise OpenAIError(f"temperature must be non-negative, got {req.temperature}",
                              param="temperature")
        try:
            return BeamSearchParams(
                beam_width=req.n, max_tokens=1,  # the resolved max_tokens is set per request
                ignore_eos=req.ignore_eos,
                temperature=0.0 if req.temperature is None else req.temperature,
                length_penalty=req.length_penalty)
        except ValueError as e:
            raise OpenAIError(str(e)) from None

    def truncated(self, token_ids: list[int]) -> list[int]:
        """The prompt after truncate_prompt_tokens (the last k tokens)."""
        if self.truncate is None or len(token_ids) <= self.truncate:
            return token_ids
        return token_ids[-self.truncate:]

    def engine_logprobs(self, logprobs: Optional[int]) -> Optional[int]:
        """best_of ranks samples by cumulative logprob, which the engine sums only when
        logprobs are asked for: at least the sampled token's."""
        if self.best_of > 1 and logprobs is None:
            return 0
        return logprobs


def best_of(output: RequestOutput, n: int) -> RequestOutput:
    """The n outputs with the highest cumulative logprob, best first, indexed 0..n-1."""
    ranked = sorted(output.outputs, key=lambda c: (-(c.cumulative_logprob or 0.0), c.index))
    output.outputs = ranked[:n]
    for i, c in enumerate(output.outputs):
        c.index = i
    return output


def usage(ctx: ServerContext, num_prompt: int, num_generated: int,
          num_cached: Optional[int]) -> UsageInfo:
    details = None
    if ctx.enable_prompt_tokens_details:
        details = PromptTokenUsageInfo(cached_tokens=num_cached or 0)
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                     total_tokens=num_prompt + num_generated, prompt_tokens_details=details)


def token_label(token_id: int, text: str, as_token_ids: bool) -> str:
    """A logprob entry's token: its text, or "token_id:N" with return_tokens_as_token_ids."""
    return f"token_id:{token_id}" if as_token_ids else text


def prompt_logprobs_json(tokenizer: Any, token_ids: list[int],
                         steps: Optional[list[Optional[dict[int, Logprob]]]], num: int,
                         as_token_ids: bool) -> Optional[PromptLogprobsJSON]:
    """vLLM's prompt_logprobs: per prompt position, the prompt token and the top `num` (by
    rank), each {"logprob", "rank", "decoded_token"}; the first position is None."""
    if steps is None:
        return None
    from pyorch.entrypoints.openai.serving_engine import clamp_logprob, token_text

    out: PromptLogprobsJSON = []
    for pos, step in enumerate(steps):
        if step is None:
            out.append(None)
            continue
        actual = token_ids[pos] if pos < len(token_ids) else None
        entries = {}
        for token_id, lp in step.items():
            if token_id != actual and (lp.rank is None or lp.rank > num):
                continue
            text = token_text(tokenizer, token_id, lp)
            entries[token_id] = {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                                 "decoded_token": token_label(token_id, text, as_token_ids)}
        out.append(entries)
    return out


async def beam_search_outputs(serving: OpenAIServing, prompts: list[list[int]],
                              params: BeamSearchParams, max_tokens: int, request_id: str,
                              priority: int, skip_special_tokens: bool,
                              ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Beam search over `prompts` on the engine: yields (prompt index, final RequestOutput) with
    the n beams as its outputs, best first, as `OpenAIServing.generate_many` yields samples."""
    from pyorch.entrypoints.openai.serving_engine import collect_finals

    params = BeamSearchParams(beam_width=params.beam_width, max_tokens=max_tokens,
                              ignore_eos=params.ignore_eos, temperature=params.temperature,
                              length_penalty=params.length_penalty)
    engine = serving.ctx.engine
    state = BeamSearchState(prompts, params, engine.eos_token_id)
    step_params = params.step_params()
    cached: list[Optional[int]] = [None] * len(prompts)
    step = 0
    while not state.done:
        beams = state.live_beams()
        merged = serving.generate_many([{"prompt_token_ids": b.tokens} for b in beams],
                                       step_params, f"{request_id}-step{step}", priority)
        finals = await collect_finals(merged, len(beams))
        if step == 0:  # the first step runs exactly the prompts
            cached = [f.num_cached_tokens for f in finals]
        state.advance([f.outputs[0].logprobs[0] for f in finals])  # type: ignore[index]
        step += 1
    tokenizer = serving.ctx.tokenizer
    for i, best in enumerate(state.outputs()):
        outputs = []
        for index, beam in enumerate(best):
            generated = state.generated(i, beam)
            shown = generated[:-1] if beam.finish_reason == "stop" else generated
            text = "" if tokenizer is None else tokenizer.decode(
                shown, skip_special_tokens=skip_special_tokens)
            outputs.append(CompletionOutput(index=index, text=text, token_ids=generated,
                                            cumulative_logprob=beam.cum_logprob, logprobs=None,
                                            finish_reason=beam.finish_reason))
        yield i, RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompts[i],
                               prompt_logprobs=None, outputs=outputs, finished=True,
                               num_cached_tokens=cached[i])
