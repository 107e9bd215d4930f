"""POST /v1/completions: prompts as text or token ids, one or many, streamed or not.

Choice `i * n + j` is sample j of prompt i, as in OpenAI's API.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pyorch.entrypoints.openai.errors import OpenAIError
from pyorch.entrypoints.openai.protocol import (
    MAX_SEQUENCES,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from pyorch.entrypoints.openai.request_fields import (
    RequestFields,
    beam_search_outputs,
    best_of,
    prompt_logprobs_json,
    token_label,
    usage,
)
from pyorch.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    TextChunks,
    clamp_logprob,
    close_quietly,
    collect_finals,
    first_output,
    ranked,
    sse,
    sse_error,
    stream_with_errors,
    token_text,
)
from pyorch.outputs import Logprob, RequestOutput


class _Prompt:
    """One prompt of the request: its text (for echo) and token ids."""

    def __init__(self, text: Optional[str], token_ids: list[int]) -> None:
        self.text, self.token_ids = text, token_ids


class OpenAIServingCompletion(OpenAIServing):
    async def _prompts(self, req: CompletionRequest, fields: RequestFields) -> list[_Prompt]:
        raw = req.prompt
        if isinstance(raw, str):
            items: list[Any] = [raw]
        elif raw and all(isinstance(p, int) for p in raw):
            items = [raw]
        else:
            items = list(raw)
        if not items:
            raise OpenAIError("the prompt is empty", param="prompt")
        if len(items) * fields.best_of > MAX_SEQUENCES:
            name = "n" if fields.best_of == req.n else "best_of"
            raise OpenAIError(f"{len(items)} prompts x {name}={fields.best_of} is more than the "
                              f"{MAX_SEQUENCES} sequences one request may ask for", param=name)
        prompts = []
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt.{i}"
            if isinstance(item, str):
                ids = await self.encode(item, req.add_special_tokens, param,
                                        truncating=fields.truncate is not None)
                kept = fields.truncated(ids)
                # echo shows what the model saw: a truncated prompt is decoded again.
                prompts.append(_Prompt(item if kept is ids else None, kept))
            else:
                prompts.append(_Prompt(None, fields.truncated(list(item))))
            self.check_prompt_ids(prompts[-1].token_ids)
        return prompts

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        self.check_engine()
        self.check_fields(req)
        if req.suffix:
            # vLLM refuses suffix for models without fill-in-the-middle support; none of the
            # models pyorch serves has a FIM template.
            raise OpenAIError("suffix is not supported: this model has no fill-in-the-middle "
                              "(FIM) support", param="suffix")
        include_usage = self.check_stream_options(req)
        fields = RequestFields.of(req, self.ctx)
        prompts = await self._prompts(req, fields)
        longest = max(len(p.token_ids) for p in prompts)
        max_tokens = self.resolve_max_tokens(req.max_tokens, longest)
        echo_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        prompt_logprobs = max((v for v in (echo_logprobs, fields.prompt_logprobs)
                               if v is not None), default=None)
        params = self.sampling_params(req, max_tokens, fields.engine_logprobs(req.logprobs),
                                      prompt_logprobs, fields.best_of)
        await self.check_structured_outputs(req, params)
        request_id = random_id("cmpl")
        for i, p in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            self.log_request(rid, p.text or p.token_ids, len(p.token_ids), params)
        if fields.beam is not None:
            merged = beam_search_outputs(self, [p.token_ids for p in prompts], fields.beam,
                                         max_tokens, request_id, req.priority,
                                         req.skip_special_tokens)
        else:
            engine_prompts = [{"prompt_token_ids": p.token_ids, "prompt": p.text}
                              for p in prompts]
            merged = self.generate_many(engine_prompts, params, request_id, req.priority)
        if req.stream:
            first = await first_output(merged)
            return StreamingResponse(
                self._stream(req, fields, prompts, first, merged, request_id, include_usage),
                media_type="text/event-stream")
        finals = await self.run_until_disconnect(raw, collect_finals(merged, len(prompts)))
        if fields.best_of > req.n:
            finals = [best_of(f, req.n) for f in finals]
        response = self._response(req, fields, prompts, finals, request_id)
        return JSONResponse(response.model_dump())

    # ---- non-streaming ------------------------------------------------------------------------
    def _response(self, req: CompletionRequest, fields: RequestFields, prompts: list[_Prompt],
                  finals: list[RequestOutput], request_id: str) -> CompletionResponse:
        choices, num_generated = [], 0
        as_ids = fields.as_token_ids
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            prompt_lps = None
            if fields.prompt_logprobs is not None:
                prompt_lps = prompt_logprobs_json(self.ctx.tokenizer, prompt.token_ids,
                                                  final.prompt_logprobs, fields.prompt_logprobs,
                                                  as_ids)
            for c in final.outputs:
                text, logprobs = c.text, None
                if req.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    offset = 0
                    if req.echo:
                        offset = self._add_logprobs(logprobs, prompt.token_ids,
                                                    final.prompt_logprobs, req.logprobs, offset,
                                                    as_ids)
                    self._add_logprobs(logprobs, c.token_ids, c.logprobs, req.logprobs, offset,
                                       as_ids)
                if req.echo:
                    text = self._prompt_text(prompt) + text
                choices.append(CompletionChoice(
                    index=i * req.n + c.index, text=text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_lps,
                    prompt_token_ids=prompt.token_ids if fields.return_token_ids else None,
                    token_ids=list(c.token_ids) if fields.return_token_ids else None))
                num_generated += len(c.token_ids)
        num_prompt = sum(len(p.token_ids) for p in prompts)
        num_cached = sum(f.num_cached_tokens or 0 for f in finals)
        return CompletionResponse(id=request_id, model=self.ctx.model_name, choices=choices,
                                  usage=usage(self.ctx, num_prompt, num_generated, num_cached))

    def _prompt_text(self, prompt: _Prompt) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer().decode(prompt.token_ids)
        return prompt.text

    def _add_logprobs(self, out: CompletionLogprobs, token_ids: list[int],
                      steps: Optional[Sequence[Optional[dict[int, Logprob]]]], num: int,
                      offset: int, as_ids: bool = False) -> int:
        """Appends OpenAI's (tokens, token_logprobs, top_logprobs, text_offset) for
        `token_ids`; returns the text offset after them."""
        tok = self.ctx.tokenizer
        for i, token_id in enumerate(token_ids):
            step = steps[i] if steps is not None and i < len(steps) else None
            chosen = step.get(token_id) if step else None
            text = token_text(tok, token_id, chosen)
            out.tokens.append(token_label(token_id, text, as_ids))
            out.text_offset.append(offset)
            offset += len(text)
            if step is None or chosen is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(clamp_logprob(chosen.logprob))
            top = {token_label(token_id, text, as_ids): clamp_logprob(chosen.logprob)}
            for t, lp in ranked(step, num):
                top.setdefault(token_label(t, token_text(tok, t, lp), as_ids),
                               clamp_logprob(lp.logprob))
            out.top_logprobs.append(top)
        return offset

    # ---- streaming ----------------------------------------------------------------------------
    async def _stream(self, req: CompletionRequest, fields: RequestFields,
                      prompts: list[_Prompt], first: Any, merged: Any, request_id: str,
                      include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        n = req.n
        offsets = [0] * (len(prompts) * n)
        echoed = [False] * (len(prompts) * n)
        started = [False] * (len(prompts) * n)
        per_choice = [0] * (len(prompts) * n)
        cached = [0] * len(prompts)
        as_ids = fields.as_token_ids
        # Chunks carry no prompt_logprobs (refused with stream) and token ids only if asked.
        # Each chunk is a plain dict in CompletionChoice's field order (its model_dump, minus
        # the pydantic round trip: this runs once per token per stream).
        return_ids = fields.return_token_ids
        model_name = self.ctx.model_name
        plain = TextChunks({"id": request_id, "object": "text_completion", "created": created,
                            "model": model_name}, '{"index":{index},"text":',
                           ',"logprobs":null,"finish_reason":null,"stop_reason":null}')
        plain_only = not return_ids and not fields.continuous_usage
        num_generated = 0
        try:
            async for prompt_idx, output in stream_with_errors(first, merged):
                prompt = prompts[prompt_idx]
                cached[prompt_idx] = max(cached[prompt_idx], output.num_cached_tokens or 0)
                for c in output.outputs:
                    index = prompt_idx * n + c.index
                    text, logprobs = c.text, None
                    if req.logprobs is not None:
                        logprobs = CompletionLogprobs()
                    if req.echo and not echoed[index]:
                        echoed[index] = True
                        text = self._prompt_text(prompt) + text
                        if logprobs is not None:
                            assert req.logprobs is not None  # logprobs is made only then
                            offsets[index] = self._add_logprobs(
                                logprobs, prompt.token_ids, output.prompt_logprobs,
                                req.logprobs, offsets[index], as_ids)
                    if logprobs is not None:
                        assert req.logprobs is not None  # logprobs is made only then
                        offsets[index] = self._add_logprobs(logprobs, c.token_ids, c.logprobs,
                                                            req.logprobs, offsets[index], as_ids)
                    num_generated += len(c.token_ids)
                    per_choice[index] += len(c.token_ids)
                    if not text and logprobs is None and c.finish_reason is None:
                        continue  # nothing new (e.g. an incomplete UTF-8 character)
                    if (plain_only and logprobs is None and c.finish_reason is None
                            and c.stop_reason is None):
                        started[index] = True
                        yield plain.chunk(index, text)
                        continue
                    choice: dict[str, Any] = {
                        "index": index, "text": text,
                        "logprobs": None if logprobs is None else logprobs.model_dump(),
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if return_ids:
                        choice["prompt_token_ids"] = (None if started[index]
                                                      else prompt.token_ids)
                        choice["token_ids"] = list(c.token_ids)
                    started[index] = True
                    body: dict[str, Any] = {
                        "id": request_id, "object": "text_completion", "created": created,
                        "model": model_name, "choices": [choice]}
                    if fields.continuous_usage:  # vLLM: this choice's counts so far
                        body["usage"] = UsageInfo(
                            prompt_tokens=len(prompt.token_ids),
                            completion_tokens=per_choice[index],
                            total_tokens=len(prompt.token_ids) + per_choice[index]).model_dump()
                    yield sse(body)
            if include_usage:
                num_prompt = sum(len(p.token_ids) for p in prompts)
                final_usage = usage(self.ctx, num_prompt, num_generated, sum(cached))
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": self.ctx.model_name, "choices": [],
                           "usage": final_usage.model_dump()})
        except Exception as e:
            yield sse_error(e)
        finally:
            await close_quietly(merged)
        yield SSE_DONE

