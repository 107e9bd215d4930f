"""What the completion and chat handlers share: model-name checks, prompt checks, SamplingParams
from a request, running several prompts at once, client-disconnect handling, logprobs and SSE.

Ownership: the API process tokenizes and validates every prompt here, before anything reaches
the engine, so that a bad request is a 400 that costs the engine nothing. `AsyncLLM.generate`
validates again (the same rules); its rare ValueError is still answered with 400.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Optional,
    TypeVar,
    cast,
)

import anyio
from fastapi import Request

from pyorch.engine.exceptions import EngineDeadError
from pyorch.engine.input_processor import (
    check_num_logprobs,
    check_prompt,
    check_prompt_text,
    check_text,
)
from pyorch.entrypoints.openai.errors import OpenAIError, engine_dead_message, error_body
from pyorch.entrypoints.openai.protocol import SamplingExtras
from pyorch.outputs import Logprob, RequestOutput
from pyorch.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pyorch.engine.async_llm import AsyncLLM

logger = logging.getLogger("pyorch.entrypoints.openai")

T = TypeVar("T")
# JSON has no -inf; OpenAI's and vLLM's floor for impossible tokens.
MIN_LOGPROB = -9999.0


@dataclass
class ServerContext:
    """What every handler needs: the engine, the names it answers to, and the limits."""

    engine: AsyncLLM
    served_model_names: list[str]
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # a transformers tokenizer; None with skip_tokenizer_init
    chat_template: Optional[str] = None
    # --enable-log-requests (vLLM's): one INFO line per request, its prompt at DEBUG, cut to
    # max_log_len characters or token ids (None: all of it).
    log_requests: bool = False
    max_log_len: Optional[int] = None
    # K of `max_chars_per_token`: prompts longer than max_model_len * K characters are refused
    # before they are tokenized (None: this tokenizer gives no such guarantee).
    chars_per_token: Optional[int] = None
    # The pool that tokenizes and renders chat templates (vLLM's renderer_num_workers), so that
    # a long prompt never holds up the event loop; None runs them inline (tests, tools).
    renderer: Optional[ThreadPoolExecutor] = None
    # Tool calling and reasoning (--enable-auto-tool-choice, --tool-call-parser,
    # --exclude-tools-when-tool-choice-none, --reasoning-parser); see chat_output.py.
    enable_auto_tools: bool = False
    tool_call_parser: Optional[str] = None
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: Optional[str] = None
    # --structured-outputs-config's disable_any_whitespace: every JSON constraint compact.
    structured_outputs_disable_any_whitespace: bool = False
    # --max-logprobs (-1: no cap); default sampling parameters from the generation config
    # (--generation-config, --override-generation-config); the answer's role
    # (--response-role); how message content reaches the chat template (string / openai).
    max_logprobs: int = 20
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    response_role: str = "assistant"
    content_format: str = "string"
    # --scheduling-policy (a request's `priority` needs "priority").
    scheduling_policy: str = "fcfs"
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens.
    enable_prompt_tokens_details: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def _off(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


# Fields that OpenAI or vLLM define, that would change the output, and that pyorch does not
# implement: refused with 400 naming the field unless given their neutral value (a silent
# "accepted" would hand back, say, free text to a caller that asked for JSON). Other unknown
# fields are ignored with a log line, as vLLM does: OpenAI clients send fields newer than us.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logits_processors": _off,
    # vLLM's legacy knobs of the guided_* fields: xgrammar is our only backend and has no
    # custom whitespace pattern.
    "guided_decoding_backend": _off, "guided_whitespace_pattern": _off,
    # OpenAI's deprecated forms of tools / tool_choice; vLLM does not implement them either.
    "functions": _off,
    "function_call": lambda v: v is None or v in ("none", "auto"),
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _off, "prediction": _off,
}


class OpenAIServing:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        # Tasks that outlive a cancelled handler while they close their generators.
        self._background: set[asyncio.Task] = set()

    # ---- checks -------------------------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.ctx.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    def check_engine(self) -> None:
        if self.ctx.engine.errored:
            raise EngineDeadError(engine_dead_message())

    def tokenizer(self) -> Any:
        if self.ctx.tokenizer is None:
            raise OpenAIError("this server has no tokenizer (skip_tokenizer_init)")
        return self.ctx.tokenizer

    async def render(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs CPU-heavy preprocessing (tokenizing, chat templates) on the renderer pool. HF
        fast tokenizers encode in Rust and release the GIL meanwhile, so the event loop keeps
        streaming other requests' tokens and answering /health."""
        if self.ctx.renderer is None:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.ctx.renderer,
                                          functools.partial(fn, *args, **kwargs))

    @staticmethod
    def check_text(text: str, param: str) -> None:
        """400 naming `param` for text that is not valid Unicode (a lone surrogate)."""
        try:
            check_text(text, param)
        except ValueError as e:
            raise OpenAIError(str(e), param=param) from None

    def check_prompt_text(self, text: str, param: str = "prompt") -> None:
        """The prompt rules that need no tokenizer (input_processor.check_prompt_text)."""
        try:
            check_prompt_text(text, self.ctx.max_model_len, self.ctx.chars_per_token, param)
        except ValueError as e:
            raise OpenAIError(str(e), param=param) from None

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt",
                     truncating: bool = False) -> list[int]:
        """Token ids of a prompt text, on the renderer pool, after the cheap checks: a text too
        long to fit is refused by its length alone (O(1)); a lone surrogate is found by a regex
        scan on the pool too (it is O(n) as well). `truncating` (truncate_prompt_tokens): a
        text of any length is tokenized (the body limit bounds it) and cut afterwards."""
        tokenizer = self.tokenizer()
        if truncating:
            def work_all() -> list[int]:
                self.check_text(text, param)
                return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

            return await self.render(work_all)
        if (self.ctx.chars_per_token is not None
                and len(text) > self.ctx.max_model_len * self.ctx.chars_per_token):
            self.check_prompt_text(text, param)  # raises at once, naming the length

        def work() -> list[int]:
            self.check_prompt_text(text, param)
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

        return await self.render(work)

    def check_prompt_ids(self, token_ids: list[int]) -> None:
        try:
            check_prompt(token_ids, self.ctx.vocab_size, self.ctx.max_model_len)
        except ValueError as e:
            raise OpenAIError(str(e), param="prompt") from None

    def resolve_max_tokens(self, requested: Optional[int], num_prompt: int) -> int:
        """OpenAI's rule: prompt + completion must fit max_model_len (the default fills it)."""
        room = self.ctx.max_model_len - num_prompt
        max_tokens = room if requested is None else requested
        if max_tokens > room or max_tokens < 1:
            raise OpenAIError(
                f"This model's maximum context length is {self.ctx.max_model_len} tokens. "
                f"However, you requested {num_prompt + max_tokens} tokens ({num_prompt} in the "
                f"prompt, {max_tokens} in the completion). Please reduce the length of the "
                "prompt or completion.", param="max_tokens")
        # vLLM's get_max_tokens: the generation config's max_new_tokens caps it too.
        default_max = self.ctx.default_sampling_params.get("max_tokens")
        return max_tokens if default_max is None else min(max_tokens, int(default_max))

    @staticmethod
    def check_fields(req: Any) -> None:
        """400 for a field we know but do not implement (`_UNSUPPORTED`) unless it is neutral;
        a log line for fields we do not know at all."""
        extra = req.model_extra or {}
        for name, value in extra.items():
            neutral = _UNSUPPORTED.get(name)
            if neutral is None:
                continue
            if not neutral(value):
                hint = " (use `tools` and `tool_choice`)" if name.startswith("function") else ""
                raise OpenAIError(f"`{name}` is not supported by this server{hint}", param=name)
        unknown = sorted(k for k in extra if k not in _UNSUPPORTED)
        if unknown:
            logger.warning("ignored request fields this server does not know: %s",
                           ", ".join(unknown)[:300])

    @staticmethod
    def check_stream_options(req: SamplingExtras) -> bool:
        """Whether usage goes into the final streaming chunk."""
        if req.stream_options is not None and not req.stream:
            raise OpenAIError("stream_options can only be given when stream=true",
                              param="stream_options")
        return bool(req.stream and req.stream_options and req.stream_options.include_usage)

    def sampling_params(self, req: SamplingExtras, max_tokens: int, logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None,
                        best_of: Optional[int] = None) -> SamplingParams:
        """The request's SamplingParams; `best_of` samples (default n) are generated."""
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        for i, stop in enumerate(stops):
            self.check_text(stop, "stop" if isinstance(req.stop, str) else f"stop.{i}")
        for i, word in enumerate(req.bad_words or []):
            self.check_text(word, f"bad_words.{i}")
        constraint = structured_outputs(req)
        if constraint is not None and self.ctx.structured_outputs_disable_any_whitespace:
            constraint.disable_any_whitespace = True
        # Unset knobs take the generation config's defaults (vLLM's rule), else the neutral ones.
        defaults = self.ctx.default_sampling_params

        def knob(value: Any, name: str, neutral: float) -> Any:
            return value if value is not None else defaults.get(name, neutral)

        try:
            params = SamplingParams(
                n=req.n if best_of is None else best_of,
                temperature=knob(req.temperature, "temperature", 1.0),
                top_p=knob(req.top_p, "top_p", 1.0),
                top_k=knob(req.top_k, "top_k", 0),
                min_p=knob(req.min_p, "min_p", 0.0),
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=knob(req.repetition_penalty, "repetition_penalty", 1.0),
                seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                bad_words=req.bad_words, allowed_token_ids=req.allowed_token_ids,
                ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                # OpenAI's JSON keys are strings: SamplingParams converts them to token ids.
                logit_bias=cast(Optional[dict[int, float]], req.logit_bias),
                output_kind=RequestOutputKind.DELTA if req.stream
                else RequestOutputKind.FINAL_ONLY,
                structured_outputs=constraint,
            )
            params.validate_token_ids(self.ctx.vocab_size)
        except (ValueError, TypeError) as e:
            raise OpenAIError(str(e)) from None
        try:
            check_num_logprobs(params, self.ctx.max_logprobs, self.ctx.vocab_size)
        except ValueError as e:
            if not hasattr(req, "top_logprobs"):
                raise OpenAIError(str(e), param="logprobs") from None
            # Chat names the count top_logprobs (logprobs is its on/off switch).
            raise OpenAIError(str(e).replace("Requested logprobs", "Requested top_logprobs"),
                              param="top_logprobs") from None
        return params

    async def check_structured_outputs(self, req: SamplingExtras,
                                       params: SamplingParams) -> None:
        """400 with xgrammar's reason for a schema, regex or grammar that does not compile
        (checked on the renderer pool: the first check imports xgrammar, which takes seconds)."""
        if params.structured_outputs is None:
            return
        if self.ctx.tokenizer is None:
            raise OpenAIError("structured output needs a tokenizer (skip_tokenizer_init)",
                              param=_structured_field(req))
        from pyorch.structured_output import validate_structured_outputs

        try:
            await self.render(validate_structured_outputs, params.structured_outputs)
        except ValueError as e:
            raise OpenAIError(str(e), param=_structured_field(req)) from None

    def log_request(self, request_id: str, prompt: Any, num_tokens: int,
                    params: SamplingParams) -> None:
        if not self.ctx.log_requests:
            return
        logger.info("request %s: %d prompt tokens, n=%d, max_tokens=%s, temperature=%s, "
                    "stream=%s", request_id, num_tokens, params.n, params.max_tokens,
                    params.temperature, params.output_kind == RequestOutputKind.DELTA)
        if logger.isEnabledFor(logging.DEBUG):
            limit = self.ctx.max_log_len
            logger.debug("request %s: prompt: %r", request_id,
                         prompt if limit is None else prompt[:limit])

    # ---- running prompts ---------------------------------------------------------------------
    async def generate_many(self, prompts: list[dict], params: SamplingParams,
                            request_id: str, priority: int = 0,
                            ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Runs every prompt concurrently; yields (prompt index, output) as they come.

        Closing this generator early (client gone, error) closes every engine generator, which
        aborts those requests in the engine and frees their KV blocks.
        """
        if len(prompts) == 1:  # the usual case: no pump task, one hop less per output
            gen = self.ctx.engine.generate(prompts[0], params, request_id, priority=priority)
            try:
                async for output in gen:
                    yield 0, output
            finally:
                # The engine generator's clean-up (abort) is synchronous: this never suspends,
                # so it also runs under a cancelled anyio scope.
                await gen.aclose()
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int) -> None:
            rid = request_id if len(prompts) == 1 else f"{request_id}-{index}"
            gen = self.ctx.engine.generate(prompts[index], params, rid, priority=priority)
            try:
                async for output in gen:
                    queue.put_nowait((index, output))
                queue.put_nowait((index, done))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # handed to the consumer, which re-raises it
                queue.put_nowait((index, e))
            finally:
                await gen.aclose()

        tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            # Not awaited: under a cancelled anyio scope every await would raise again. The
            # tasks close their engine generators on their own.
            for task in tasks:
                if not task.done():
                    task.cancel()
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)

    async def run_until_disconnect(self, request: Request, work: Awaitable[T]) -> T:
        """Awaits `work`, cancelling it if the client goes away first (vLLM's
        with_cancellation): its engine requests are then aborted."""
        work_task = asyncio.ensure_future(work)
        watch_task = asyncio.create_task(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch_task.cancel()
            if not work_task.done():
                work_task.cancel()
        if not work_task.done():
            logger.info("client disconnected; request aborted")
            raise OpenAIError("client disconnected", 499)
        return work_task.result()


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _structured_field(req: SamplingExtras) -> str:
    """The request field that carries its constraint (for error messages)."""
    for name in ("response_format", "structured_outputs", *_GUIDED):
        if getattr(req, name) is not None:
            return name
    return "structured_outputs"


def structured_outputs(req: SamplingExtras) -> Optional[StructuredOutputsParams]:
    """The request's constraint with vLLM's semantics: `response_format` json_schema -> json
    (the schema), json_object -> json_object, text -> none; `guided_json/regex/choice/grammar`
    -> the same field of StructuredOutputsParams; `structured_outputs` as given. More than one
    constraint is a 400."""
    given: dict[str, Any] = {}
    fields_used: list[str] = []
    fmt = req.response_format
    if fmt is not None:
        for name in ("format", "structures", "triggers"):
            if getattr(fmt, name) is not None and fmt.type != "structural_tag":
                raise OpenAIError(f"response_format.{name} is only used with type "
                                  "structural_tag", param=f"response_format.{name}")
    if fmt is not None and fmt.type != "text":
        fields_used.append("response_format")
        if fmt.type == "json_object":
            given["json_object"] = True
        elif fmt.type == "structural_tag":
            given["structural_tag"] = _structural_tag(fmt)
        else:
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise OpenAIError("response_format of type json_schema needs "
                                  "json_schema.schema", param="response_format")
            given["json"] = fmt.json_schema.json_schema
    for name, key in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            fields_used.append(name)
            given[key] = value
    options: dict[str, Any] = {}
    if req.structured_outputs is not None:
        fields_used.append("structured_outputs")
        options = dict(req.structured_outputs)
    if len(fields_used) > 1:
        raise OpenAIError(f"only one structured-output constraint per request, got "
                          f"{', '.join(fields_used)}", param=fields_used[1])
    if not fields_used:
        return None
    try:
        return StructuredOutputsParams(**{**options, **given})
    except TypeError as e:  # an unknown key inside structured_outputs
        raise OpenAIError(f"structured_outputs: {e}", param="structured_outputs") from None
    except ValueError as e:
        raise OpenAIError(str(e), param=fields_used[0]) from None


def _structural_tag(fmt: Any) -> str:
    """vLLM's structural tag of a response_format: the whole object as JSON (xgrammar's format
    under `format`, or the legacy `structures` + `triggers`)."""
    if (fmt.format is None) == (fmt.structures is None):
        raise OpenAIError("a structural_tag response_format needs either `format` or "
                          "`structures` and `triggers`", param="response_format")
    if fmt.structures is not None and fmt.triggers is None:
        raise OpenAIError("a structural_tag with `structures` needs `triggers`",
                          param="response_format.triggers")
    body = fmt.model_dump(by_alias=True, exclude_none=True, exclude={"json_schema"})
    return json.dumps(body)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def close_quietly(gen: Any) -> None:
    """Closes an async generator even inside a cancelled anyio scope."""
    with anyio.CancelScope(shield=True):
        await gen.aclose()


# ---- SSE ----------------------------------------------------------------------------------------
def sse(payload: Any) -> str:
    if not isinstance(payload, str):
        payload = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"

# What json.dumps(..., ensure_ascii=False) writes for a str (the C encoder).
_json_string = json.encoder.encode_basestring


class TextChunks:
    """Streamed chunks that carry one choice's new text and nothing else (no logprobs, token
    ids, usage or finish reason): the usual chunk, one per token per stream. Each is the exact
    text `sse(body)` writes for such a body, built from a JSON prefix made once per choice and
    the encoded text, without building or serializing a dict per token.

    `head`: the chunk's keys before "choices" (id, object, created, model), in order;
    `choice_open`: the choice's JSON up to its text value, with `{index}` in it;
    `choice_close`: the rest of the choice after the text, with its closing braces.
    """

    def __init__(self, head: dict[str, Any], choice_open: str, choice_close: str) -> None:
        encoded = json.dumps(head, ensure_ascii=False, separators=(",", ":"))
        self._open = "data: " + encoded[:-1] + ',"choices":[' + choice_open
        self._close = choice_close + "]}\n\n"
        self._prefixes: dict[int, str] = {}

    def chunk(self, index: int, text: str) -> str:
        prefix = self._prefixes.get(index)
        if prefix is None:
            prefix = self._prefixes[index] = self._open.replace("{index}", str(index))
        return prefix + _json_string(text) + self._close


def sse_error(exc: BaseException) -> str:
    if isinstance(exc, EngineDeadError):
        return sse(error_body(engine_dead_message(), 503))
    if isinstance(exc, OpenAIError):
        return sse(error_body(exc.message, exc.status, exc.param))
    if isinstance(exc, (ValueError, TypeError)):
        return sse(error_body(str(exc), 400))
    logger.error("error while streaming: %s: %s", type(exc).__name__, exc)
    return sse(error_body(f"internal server error: {type(exc).__name__}: {exc}", 500))


async def stream_with_errors(first: Optional[tuple[int, RequestOutput]],
                             merged: AsyncGenerator[tuple[int, RequestOutput], None],
                             ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`first` (already taken to validate the request) then the rest of `merged`."""
    if first is not None:
        yield first
    async for item in merged:
        yield item


async def first_output(merged: AsyncGenerator[tuple[int, RequestOutput], None],
                       ) -> Optional[tuple[int, RequestOutput]]:
    """The first output, so that a request the engine refuses is a 400 before streaming starts
    (AsyncLLM raises its validation errors from the first __anext__)."""
    try:
        return await merged.__anext__()
    except StopAsyncIteration:
        return None
    except (ValueError, TypeError) as e:
        await close_quietly(merged)
        raise OpenAIError(str(e)) from None
    except BaseException:
        await close_quietly(merged)
        raise


async def collect_finals(merged: AsyncGenerator[tuple[int, RequestOutput], None],
                         num_prompts: int) -> list[RequestOutput]:
    """The final output of every prompt (FINAL_ONLY outputs; a later one replaces an earlier)."""
    finals: list[Optional[RequestOutput]] = [None] * num_prompts
    try:
        async for index, output in merged:
            finals[index] = output
    except (ValueError, TypeError) as e:  # AsyncLLM's validation errors
        raise OpenAIError(str(e)) from None
    finally:
        await close_quietly(merged)
    missing = [i for i, f in enumerate(finals) if f is None]
    if missing:
        raise RuntimeError(f"the engine returned no output for prompts {missing}")
    return finals  # type: ignore[return-value]


# ---- logprobs -----------------------------------------------------------------------------------
def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else float(value)


def token_text(tokenizer: Any, token_id: int, logprob: Optional[Logprob] = None) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def ranked(step: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The top-`num` entries of one position, by rank."""
    entries = [(t, lp) for t, lp in step.items() if lp.rank is not None and lp.rank <= num]
    entries.sort(key=lambda e: e[1].rank)  # type: ignore[arg-type, return-value]
    return entries[:num]
