"""Engine configuration: what the model is, how the KV cache and the scheduler are sized.

`EngineArgs` (pyorch/engine/arg_utils.py) turns vLLM-named user arguments into a `VllmConfig`-like
`EngineConfig` made of these parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pyorch.pooling_params import PoolerConfig

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")


@dataclass
class ModelConfig:
    """The model to load and how. `hf_config` is filled by `resolve()`."""

    model: str  # a Hugging Face directory, a .gguf file, or a model folder with dummy weights
    tokenizer: Optional[str] = None  # defaults to `model`
    skip_tokenizer_init: bool = False  # token ids in, token ids out
    dtype: Any = "auto"  # "auto" | "float32" | "float16" | "bfloat16" | torch.dtype
    seed: int = 0
    max_model_len: Optional[int] = None  # defaults to the model's context length
    load_format: str = "auto"  # "auto" | "safetensors" | "gguf" | "dummy"
    device: str = "cpu"
    revision: Optional[str] = None
    trust_remote_code: bool = False
    enforce_eager: bool = False  # no CUDA graphs
    cuda_graph_sizes: Optional[list[int]] = None  # padded batch sizes (tokens) to capture
    # vLLM's --runner / --convert: "pooling" (or convert "embed") serves a decoder model as an
    # embedding model (prefill only, pooled final hidden states); resolve() decides "auto".
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: Optional[PoolerConfig] = None  # pooling runner only; resolve() fills it
    hf_config: Any = None

    def resolve(self) -> None:
        """Loads the HF config, resolves dtype and max_model_len (raises on bad values)."""
        from pyorch.model_loader import load_hf_config, resolve_dtype

        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.hf_config is None:
            self.hf_config = load_hf_config(self.model, self.revision, self.trust_remote_code)
        self.dtype = resolve_dtype(self.hf_config, self.dtype, self.device)
        self._resolve_runner()
        derived = derive_max_model_len(self.hf_config)
        if self.max_model_len is None:
            if derived is None:
                raise ValueError(
                    "the model's config gives no context length (max_position_embeddings, "
                    "n_positions, max_seq_len or seq_length): set max_model_len"
                )
            self.max_model_len = derived
        elif self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        elif derived is not None and self.max_model_len > derived:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's context length "
                f"({derived}, from its config)"
            )

    def _resolve_runner(self) -> None:
        """vLLM's runner/convert rules for the decoder (*ForCausalLM) models pyorch has: they
        generate by default and become embedding models with runner="pooling" or
        convert="embed" (LAST pooling, normalized, unless pooler_config says otherwise)."""
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}"
                             + (" (draft models are not supported)" if self.runner == "draft"
                                else ""))
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got "
                             f"{self.convert!r}" + (" (classification adapters are not "
                                                    "supported)" if self.convert == "classify"
                                                    else ""))
        if self.runner == "auto":
            self.runner = "pooling" if self.convert == "embed" else "generate"
        if self.runner == "generate":
            if self.convert == "embed":
                raise ValueError("convert='embed' makes a pooling model: it needs "
                                 "runner='pooling' (or runner='auto'), not runner='generate'")
            if self.pooler_config is not None:
                raise ValueError("pooler_config applies to pooling models only: set "
                                 "runner='pooling' (or convert='embed')")
            return
        if self.convert == "none":
            raise ValueError("This model does not support `--runner pooling` without a "
                             "conversion: use convert='embed' (or 'auto')")
        self.convert = "embed"
        config = PoolerConfig.from_value(self.pooler_config) or PoolerConfig()
        if config.pooling_type is None:
            config.pooling_type = "LAST"
        if config.dimensions is not None:
            from pyorch.pooling_params import check_matryoshka

            check_matryoshka(config.dimensions, int(self.hf_config.hidden_size), self.hf_config)
        self.pooler_config = config

    @property
    def is_pooling(self) -> bool:
        """Whether this engine serves a pooling (embedding) model (after resolve())."""
        return self.runner == "pooling"

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)

    @property
    def head_size(self) -> int:
        c = self.hf_config
        head_dim = getattr(c, "head_dim", None)
        return int(head_dim or c.hidden_size // c.num_attention_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


def derive_max_model_len(hf_config: Any) -> Optional[int]:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    return None


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9  # fraction of the GPU the engine may use, KV cache included
    kv_cache_memory_bytes: Optional[int] = None  # explicit KV budget (the way to size it on CPU)
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"
    num_blocks: Optional[int] = None  # decided by the model runner from measurement

    def validate(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {self.cache_dtype!r} is not supported yet (auto)")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority"
    # Schedule and launch step N+1 before step N's tokens are read (overlaps host and device).
    async_scheduling: bool = False
    # Admit a request only while the KV cache keeps room for the running requests' expected
    # growth (Scheduler docstring); False admits whatever fits now and relies on preemption.
    reserve_kv_for_growth: bool = True

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {self.policy!r}")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def validate(self) -> None:
        if self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1:
            raise ValueError(
                "pyorch serves one GPU (or the CPU) today: tensor_parallel_size and "
                "pipeline_parallel_size must be 1"
            )


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
