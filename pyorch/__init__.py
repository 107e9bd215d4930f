"""pyorch: a high-throughput, memory-efficient LLM inference and serving engine.

`import pyorch` is light: it loads neither torch nor the extension. The ops (`torch.ops.pyorch.*`)
are registered when `pyorch._ops` (or `pyorch._C`) is imported, which the model runner, layers and
block pool do; the API-server process never imports them (see docs/architecture.md).
"""

from typing import Any

__version__ = "0.1.0"

# Imported on first use, so that `import pyorch` stays light.
_LAZY = {
    "LLM": "pyorch.entrypoints.llm",
    "LLMEngine": "pyorch.engine.llm_engine",
    "AsyncLLM": "pyorch.engine.async_llm",
    "EngineArgs": "pyorch.engine.arg_utils",
    "SamplingParams": "pyorch.sampling_params",
    "StructuredOutputsParams": "pyorch.sampling_params",
    "BeamSearchParams": "pyorch.beam_search",
    "RequestOutput": "pyorch.outputs",
    "CompletionOutput": "pyorch.outputs",
    "PoolingParams": "pyorch.pooling_params",
    "PoolerConfig": "pyorch.pooling_params",
    "PoolingOutput": "pyorch.pooling_outputs",
    "PoolingRequestOutput": "pyorch.pooling_outputs",
    "EmbeddingOutput": "pyorch.pooling_outputs",
    "EmbeddingRequestOutput": "pyorch.pooling_outputs",
    "ScoringOutput": "pyorch.pooling_outputs",
    "ScoringRequestOutput": "pyorch.pooling_outputs",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pyorch' has no attribute {name!r}")
