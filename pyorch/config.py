"""Engine configuration: what the model is, how the KV cache and the scheduler are sized.

`EngineArgs` (pyorch/engine/arg_utils.py) turns vLLM-named user arguments into a `VllmConfig`-like
`EngineConfig` made of these parts.
"""

from __future__ import annotations

import os
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
    # vLLM's switch: True never runs cascade attention (decode steps whose requests share a long
    # cached prefix attend to it once per group; pyorch/executor/cascade.py decides per step).
    disable_cascade_attn: bool = False
    cuda_graph_sizes: Optional[list[int]] = None  # padded batch sizes (tokens) to capture
    tokenizer_mode: str = "auto"  # "auto" | "hf" (the fast tokenizer if any) | "slow"
    download_dir: Optional[str] = None  # where hub models are downloaded to (HF cache if None)
    max_logprobs: int = 20  # most logprobs / prompt_logprobs per request; -1 = no cap
    # Default sampling parameters: "auto" (the model's generation_config.json), "vllm" (none),
    # or a folder holding a generation_config.json; then override_generation_config on top.
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # vLLM's --runner / --convert: "pooling" (or convert "embed") serves a decoder model as an
    # embedding model (prefill only, pooled final hidden states); resolve() decides "auto".
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: Optional[PoolerConfig] = None  # pooling runner only; resolve() fills it
    # vLLM's quantization: a method name ("fp8", "compressed-tensors", ...), or None to use the
    # checkpoint's quantization_config if any; resolve() checks that the two agree.
    quantization: Optional[str] = None
    hf_config: Any = None

    def resolve(self) -> None:
        """Loads the HF config, resolves dtype and max_model_len (raises on bad values)."""
        from pyorch.model_loader import load_hf_config, resolve_dtype

        self._check_settings()
        if self.download_dir is not None:
            self._download()
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.hf_config is None:
            self.hf_config = load_hf_config(self.model, self.revision, self.trust_remote_code)
        self.dtype = resolve_dtype(self.hf_config, self.dtype, self.device)
        self._resolve_quantization()
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

    def verify_with_parallel_config(self, parallel_config: "ParallelConfig") -> None:
        """Raises when the model cannot be split over tensor_parallel_size ranks (vLLM's
        check): attention heads must divide evenly; KV heads must divide evenly or be fewer
        than the ranks and divide them (then each KV head is replicated)."""
        tp = parallel_config.tensor_parallel_size
        heads = int(self.hf_config.num_attention_heads)
        if heads % tp:
            raise ValueError(
                f"Total number of attention heads ({heads}) must be divisible by tensor "
                f"parallel size ({tp})."
            )
        kv_heads = self.num_kv_heads
        if (kv_heads >= tp and kv_heads % tp) or (kv_heads < tp and tp % kv_heads):
            raise ValueError(
                f"Total number of KV heads ({kv_heads}) and tensor parallel size ({tp}) must "
                "divide one another."
            )
        # Expert parallelism needs experts (vLLM's check and message).
        if parallel_config.enable_expert_parallel and self.num_experts == 0:
            raise ValueError("Number of experts in the model must be greater than 0 when "
                             "expert parallelism is enabled.")
        if parallel_config.enable_expert_parallel and self.num_experts < tp:
            raise ValueError(
                f"enable_expert_parallel: the expert-parallel size (tensor_parallel_size {tp}) "
                f"is larger than the model's number of experts ({self.num_experts}); some "
                "ranks would hold no expert")

    @property
    def num_experts(self) -> int:
        """The routed experts of an MoE model's config (0 for a dense model)."""
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            value = getattr(self.hf_config, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return 0

    def _check_settings(self) -> None:
        if self.tokenizer_mode not in ("auto", "hf", "slow"):
            raise ValueError(f"tokenizer_mode {self.tokenizer_mode!r} is not supported (auto, "
                             "hf or slow)")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0 or -1 (no cap), got {self.max_logprobs!r}")
        if not isinstance(self.override_generation_config, dict):
            raise ValueError("override_generation_config must be a dict (JSON object)")
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
                os.path.join(self.generation_config, "generation_config.json")):
            raise ValueError(f"generation_config={self.generation_config!r}: expected 'auto', "
                             "'vllm' or a folder holding a generation_config.json")

    def _download(self) -> None:
        """download_dir: a hub id is fetched into (or, offline, found in) that folder, and the
        model (and its tokenizer, unless another is named) load from the snapshot there."""
        from pyorch.model_loader import hub_snapshot

        if os.path.exists(os.path.expanduser(self.model)):
            return  # a local model: nothing to download
        assert self.download_dir is not None
        local = hub_snapshot(self.model, self.revision, self.download_dir)
        if self.tokenizer in (None, self.model):
            self.tokenizer = local
        self.model = local

    @property
    def max_num_logprobs(self) -> int:
        """The logprobs cap as a number (-1 resolved to the vocabulary size)."""
        return self.vocab_size if self.max_logprobs == -1 else self.max_logprobs

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The default sampling parameters the generation config asks for (vLLM's rule): the
        fields of generation_config.json that differ from transformers' defaults (or none for
        'vllm'), updated by override_generation_config, kept to repetition_penalty,
        temperature, top_k, top_p, min_p and max_new_tokens (as max_tokens)."""
        config: dict[str, Any] = {}
        folder = self.model if self.generation_config == "auto" else self.generation_config
        if self.generation_config != "vllm" and os.path.isfile(
                os.path.join(folder, "generation_config.json")):
            from transformers import GenerationConfig

            config = GenerationConfig.from_pretrained(folder).to_diff_dict()
        config.update(self.override_generation_config)
        params = {k: config[k] for k in _GENERATION_PARAMS if config.get(k) is not None}
        if "max_new_tokens" in params:
            params["max_tokens"] = params.pop("max_new_tokens")
        return params

    def _resolve_quantization(self) -> None:
        """vLLM's _verify_quantization: the method from the checkpoint or the argument (which
        must agree); an unknown name raises listing the known ones. The quantization registry
        (pyorch.layers.quantization) is imported only for a quantized model."""
        from pyorch.model_loader.config import is_gguf

        if is_gguf(self.model) and self.load_format in ("auto", "gguf"):
            # vLLM: a GGUF file runs with the "gguf" method, which keeps its blocks
            if self.quantization not in (None, "gguf"):
                raise ValueError(f"a GGUF file runs with quantization 'gguf', not "
                                 f"{self.quantization!r}")
            self.quantization = "gguf"
            return
        if self.quantization is None and getattr(self.hf_config, "quantization_config",
                                                 None) is None:
            return
        from pyorch.model_loader.quant_config import resolve_quantization

        self.quantization = resolve_quantization(self.hf_config, self.quantization)

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


# The generation-config fields that become default sampling parameters (vLLM's list).
_GENERATION_PARAMS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p",
                      "max_new_tokens")


def derive_max_model_len(hf_config: Any) -> Optional[int]:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    return None


# kv_cache_dtype values pyorch runs (vLLM's names; "fp8" is e4m3 on NVIDIA, as in vLLM). The
# kernels store e4m3 only: fp8_e5m2 and vLLM's other kinds are refused by name.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        hint = (" (the fp8 KV cache stores e4m3 only: use fp8 or fp8_e4m3)"
                if str(kv_cache_dtype).startswith("fp8") else "")
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; expected one of "
                         f"{', '.join(KV_CACHE_DTYPES)}{hint}")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache is allocated in: the model's for "auto", else uint8 holding e4m3
    bytes (what the cache and attention ops take, as vLLM allocates its fp8 caches)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return model_dtype if kv_cache_dtype == "auto" else torch.uint8


@dataclass
class CacheConfig:
    block_size: int = 16
    # Fraction of the GPU the engine may use, KV cache included; vLLM 0.26's default (it was 0.9).
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: Optional[int] = None  # explicit KV budget (the way to size it on CPU)
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # vLLM's kv_cache_dtype: "auto" (the model's) | "fp8" | "fp8_e4m3"
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
        check_kv_cache_dtype(self.cache_dtype)


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
    # vLLM's chunked-prefill limits: most tokens of one request per step (0: none), and
    # concurrent partial prefills (1: no limit on the number, as vLLM's V1 engine).
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    # pyorch's own: size each step's prefill tokens so a step takes about this long, from the
    # measured step times (pyorch.core.step_budget). None: max_num_batched_tokens every step.
    target_step_ms: Optional[float] = None

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
        if self.max_num_partial_prefills < 1 or self.max_long_partial_prefills < 1:
            raise ValueError("max_num_partial_prefills and max_long_partial_prefills must be >= 1")
        if self.max_num_partial_prefills > 1 and not self.enable_chunked_prefill:
            raise ValueError("max_num_partial_prefills > 1 requires chunked prefill")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})")
        if self.max_num_partial_prefills > 1 and self.long_prefill_token_threshold == 0:
            # vLLM's default when partial prefills are concurrent: 4% of max_model_len.
            self.long_prefill_token_threshold = max(1, int(self.max_model_len * 0.04))
        if not 0 <= self.long_prefill_token_threshold <= self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be in "
                f"[0, max_model_len ({self.max_model_len})]")
        if self.target_step_ms is not None and not 0 < self.target_step_ms < float("inf"):
            raise ValueError(f"target_step_ms must be a positive number, got {self.target_step_ms}")


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray", "uni")
EXPERT_PLACEMENT_STRATEGIES = ("linear", "round_robin")  # vLLM's ExpertPlacementStrategy


@dataclass
class ParallelConfig:
    """How the model is split over devices (vLLM's ParallelConfig, tensor parallelism only)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni" (the runner in the engine core's process), "mp" (a worker process per rank on this
    # host), "ray" (Ray actors); None picks as vLLM does: uni for one rank, else ray inside a
    # Ray placement group, else mp.
    distributed_executor_backend: Optional[str] = None
    disable_custom_all_reduce: bool = False  # NCCL (torch.distributed) for every all-reduce
    # ---- expert parallelism (wt-ep): vLLM's names; EP size = TP x DP (DP = 1 here) ----
    enable_expert_parallel: bool = False  # MoE layers place whole experts on ranks
    expert_placement_strategy: str = "linear"  # "linear" | "round_robin"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def validate(self, device: str = "cpu") -> None:
        """Checks the sizes and resolves distributed_executor_backend (raises on bad values)."""
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                "pipeline_parallel_size must be 1: pyorch offers tensor parallelism only "
                f"(got {self.pipeline_parallel_size})"
            )
        if self.expert_placement_strategy not in EXPERT_PLACEMENT_STRATEGIES:
            raise ValueError(
                f"expert_placement_strategy {self.expert_placement_strategy!r} is not supported; "
                f"use one of {', '.join(EXPERT_PLACEMENT_STRATEGIES)}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend {backend!r} is not supported; use one of "
                f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)} (or leave it unset)"
            )
        if backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size "
                f"{self.tensor_parallel_size} needs 'mp' or 'ray'"
            )
        if backend != "ray" and device.startswith("cuda") and self.world_size > 1:
            count = torch.cuda.device_count()
            if count < self.world_size:
                raise ValueError(
                    f"World size ({self.world_size}) is larger than the number of available "
                    f"GPUs ({count}) on this host; for several hosts use "
                    "distributed_executor_backend='ray'"
                )
        if backend is None:
            self.distributed_executor_backend = (
                "uni" if self.world_size == 1 else "ray" if _in_ray_placement_group() else "mp"
            )


def _in_ray_placement_group() -> bool:
    """Whether this process runs inside a Ray placement group (vLLM then defaults to ray)."""
    import sys

    if "ray" not in sys.modules:  # never import Ray just to ask
        return False
    ray = sys.modules["ray"]
    if not ray.is_initialized():
        return False
    from ray.util import get_current_placement_group

    return get_current_placement_group() is not None


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
