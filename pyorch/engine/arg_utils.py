"""EngineArgs: the user-facing engine arguments (vLLM's names) and how they become configs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from pyorch.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pyorch.pooling_params import PoolerConfig

# vLLM's computed defaults (max_num_batched_tokens, max_num_seqs) for the LLM class.
_LARGE_GPU_DEFAULTS = (16384, 1024)  # GPUs with >= 70 GiB (H100, H200)
_GPU_DEFAULTS = (8192, 256)
_CPU_DEFAULTS = (4096, 256)
# target_step_ms="auto" (pyorch-serve's default): this on CUDA, off on the CPU.
SERVE_TARGET_STEP_MS = 40.0
# vLLM's computed defaults for the API server (usage_context "openai_api_server"): smaller steps.
_SERVER_DEFAULTS = {"large_gpu": (8192, 1024), "gpu": (2048, 256), "cpu": (2048, 128)}


@dataclass
class EngineArgs:
    model: Optional[str] = None  # None: the embedded default model (SmolLM2-135M-Instruct GGUF)
    tokenizer: Optional[str] = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    revision: Optional[str] = None
    dtype: Any = "auto"
    seed: int = 0
    max_model_len: Optional[int] = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: Optional[int] = None
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: Optional[int] = None
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    load_format: str = "auto"
    enforce_eager: bool = False
    disable_cascade_attn: bool = False  # vLLM's: never cascade attention over shared prefixes
    cuda_graph_sizes: Optional[list[int]] = None  # None: 1, 2, 4, 8, 16, ... up to 512
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # None: uni for one rank, else ray inside a Ray placement group, else mp (vLLM's choice)
    distributed_executor_backend: Optional[str] = None
    disable_custom_all_reduce: bool = False
    enable_expert_parallel: bool = False  # vLLM's: whole experts per rank (EP = TP here)
    expert_placement_strategy: str = "linear"  # "linear" | "round_robin"
    device: str = "auto"  # "auto" (CUDA when available), "cuda", "cpu"
    # None: on for CUDA (overlaps scheduling with the GPU), off on the CPU (nothing to overlap)
    async_scheduling: Optional[bool] = None
    # pyorch's own: keep KV room for running requests' expected growth (fewer preemptions)
    reserve_kv_for_growth: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    # pyorch's own: milliseconds a step should take; prefill tokens per step follow from the
    # measured step times. None or 0: off (max_num_batched_tokens every step); "auto":
    # SERVE_TARGET_STEP_MS on CUDA, off on the CPU.
    target_step_ms: Optional[Union[float, str]] = None
    tokenizer_mode: str = "auto"  # "auto" | "hf" | "slow"
    download_dir: Optional[str] = None  # where hub models are downloaded (HF cache if None)
    max_logprobs: int = 20  # most logprobs / prompt_logprobs per request; -1 = no cap
    generation_config: str = "auto"  # "auto" | "vllm" | a folder with generation_config.json
    override_generation_config: Optional[dict[str, Any]] = None
    # Pooling (embedding) models, vLLM's names: runner "auto" | "generate" | "pooling",
    # convert "auto" | "none" | "embed", pooler_config a PoolerConfig or a dict of its fields.
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: Optional[Any] = None
    # vLLM's quantization method ("fp8", "compressed-tensors", ...); None: the checkpoint's.
    quantization: Optional[str] = None
    # vLLM's UsageContext, which picks the max_num_batched_tokens / max_num_seqs defaults:
    # "llm_class" (offline) or "openai_api_server" (pyorch-serve).
    usage_context: str = "llm_class"

    @classmethod
    def field_names(cls) -> set[str]:
        """The user-facing fields (LLM(**kwargs), benchmark flags); usage_context is set by
        the entry point, as in vLLM."""
        return {f.name for f in dataclasses.fields(cls)} - {"usage_context"}

    def create_engine_config(self) -> EngineConfig:
        from pyorch.model_loader import default_model_path

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
        elif device != "cpu" and not device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
        model = self.model or default_model_path()

        parallel = ParallelConfig(
            self.tensor_parallel_size, self.pipeline_parallel_size,
            self.distributed_executor_backend, bool(self.disable_custom_all_reduce),
            enable_expert_parallel=bool(self.enable_expert_parallel),
            expert_placement_strategy=self.expert_placement_strategy,
        )
        parallel.validate(device)
        model_config = ModelConfig(
            model=model, tokenizer=self.tokenizer, skip_tokenizer_init=self.skip_tokenizer_init,
            dtype=self.dtype, seed=self.seed, max_model_len=self.max_model_len,
            load_format=self.load_format, device=device, revision=self.revision,
            trust_remote_code=self.trust_remote_code, enforce_eager=self.enforce_eager,
            disable_cascade_attn=bool(self.disable_cascade_attn),
            cuda_graph_sizes=list(self.cuda_graph_sizes) if self.cuda_graph_sizes else None,
            tokenizer_mode=self.tokenizer_mode, download_dir=self.download_dir,
            max_logprobs=self.max_logprobs, generation_config=self.generation_config,
            override_generation_config=dict(self.override_generation_config or {}),
            runner=self.runner, convert=self.convert,
            pooler_config=PoolerConfig.from_value(self.pooler_config),
            quantization=self.quantization,
        )
        model_config.resolve()
        model_config.verify_with_parallel_config(parallel)
        cache_config = CacheConfig(
            block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=self.enable_prefix_caching, cache_dtype=self.kv_cache_dtype,
            num_blocks=self.num_gpu_blocks_override,
        )
        cache_config.validate()
        tokens, seqs = self._default_batch_sizes(device)
        max_num_batched_tokens = self.max_num_batched_tokens or tokens
        max_model_len = model_config.max_model_len
        assert max_model_len is not None  # resolve() sets it (or raises)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens is None:
            max_num_batched_tokens = max(max_model_len, max_num_batched_tokens)
        max_num_seqs = self.max_num_seqs or seqs
        max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            async_scheduling=(device != "cpu" if self.async_scheduling is None
                              else bool(self.async_scheduling)),
            reserve_kv_for_growth=bool(self.reserve_kv_for_growth),
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
            target_step_ms=self._target_step_ms(device),
        )
        scheduler_config.validate()
        return EngineConfig(model_config, cache_config, scheduler_config, parallel)

    def _target_step_ms(self, device: str) -> Optional[float]:
        target = self.target_step_ms
        if target is None:
            return None
        if target == "auto":
            return SERVE_TARGET_STEP_MS if device != "cpu" else None
        try:
            value = float(target)
        except ValueError:
            raise ValueError(f"target_step_ms must be a number of milliseconds or 'auto', got "
                             f"{target!r}") from None
        if value < 0:
            raise ValueError(f"target_step_ms must be >= 0 (0: off), got {target!r}")
        return value or None

    def _default_batch_sizes(self, device: str) -> tuple[int, int]:
        if self.usage_context not in ("llm_class", "openai_api_server"):
            raise ValueError(f"usage_context must be llm_class or openai_api_server, got "
                             f"{self.usage_context!r}")
        server = self.usage_context == "openai_api_server"
        if device == "cpu":
            return _SERVER_DEFAULTS["cpu"] if server else _CPU_DEFAULTS
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        if total >= 70 * 2**30:
            return _SERVER_DEFAULTS["large_gpu"] if server else _LARGE_GPU_DEFAULTS
        return _SERVER_DEFAULTS["gpu"] if server else _GPU_DEFAULTS
