"""LLMEngine: the offline engine core. One step is three calls:
`scheduler.schedule()` -> `model_runner.execute(...)` -> `scheduler.update_from_output(...)`,
then the output processor detokenizes and builds RequestOutputs.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Optional, Union

from pyorch.config import EngineConfig
from pyorch.engine.arg_utils import EngineArgs
from pyorch.engine.output_processor import OutputProcessor
from pyorch.engine.request import Request, RequestStatus
from pyorch.engine.scheduler import Scheduler
from pyorch.executor.model_runner import ModelRunner
from pyorch.outputs import RequestOutput
from pyorch.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int], dict]
MAX_LOGPROBS = 20  # vLLM's default max_logprobs


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        mc = config.model_config
        self.tokenizer = None
        if not mc.skip_tokenizer_init:
            from pyorch.model_loader import get_tokenizer

            self.tokenizer = get_tokenizer(mc.tokenizer, trust_remote_code=mc.trust_remote_code,
                                           revision=mc.revision)
        self.model_runner = ModelRunner(config)
        self.model_runner.load_model()
        num_blocks = self.model_runner.initialize_kv_cache()
        sc, cc = config.scheduler_config, config.cache_config
        self.scheduler = Scheduler(
            max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=sc.max_model_len, block_size=cc.block_size, num_blocks=num_blocks,
            enable_prefix_caching=cc.enable_prefix_caching,
            enable_chunked_prefill=sc.enable_chunked_prefill, policy=sc.policy,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_id = self._eos_token_id()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    def _eos_token_id(self) -> Optional[int]:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        eos = getattr(self.config.model_config.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- requests ----------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"unsupported prompt type {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: PromptType,
                    params: Optional[SamplingParams] = None, arrival_time: Optional[float] = None,
                    priority: int = 0) -> None:
        """Validates and queues a request (raises ValueError on a bad one; nothing is queued)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        prompt_text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.config.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name}={value} is outside [0, {MAX_LOGPROBS}] (max_logprobs)")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True)")
        if self.config.scheduler_config.policy != "priority" and priority != 0:
            raise ValueError("priority is only supported with scheduling_policy='priority'")
        arrival_time = time.time() if arrival_time is None else arrival_time
        children = self.output_processor.add_request(
            request_id, prompt_text, token_ids, params, self.eos_token_id, vocab)
        added: list[str] = []
        try:
            for child_id, child_params in children:
                self.scheduler.add_request(Request(
                    request_id=child_id, prompt_token_ids=token_ids, sampling_params=child_params,
                    eos_token_id=self.eos_token_id, arrival_time=arrival_time, priority=priority))
                added.append(child_id)
        except Exception:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort_requests([request_id])
            raise

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids = self.output_processor.abort_requests(ids)
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:  # stop strings found by the detokenizer
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()
