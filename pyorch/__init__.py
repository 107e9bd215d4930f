"""pyorch: a high-throughput, memory-efficient LLM inference and serving engine."""

from typing import Any

import torch  # noqa: F401  (loads libtorch before the extension)

from pyorch import _C, envs  # noqa: F401  (registers torch.ops.pyorch.*)

if _C.with_cuda:  # the kernels' PDL switch is process state of the C API (pyorch/launch.h)
    _C.set_pdl_enabled(envs.PYORCH_PDL)

__version__ = "0.1.0"

# The engine pulls in transformers; import it on first use so `import pyorch` stays light.
_LAZY = {
    "LLM": "pyorch.entrypoints.llm",
    "LLMEngine": "pyorch.engine.llm_engine",
    "AsyncLLM": "pyorch.engine.async_llm",
    "EngineArgs": "pyorch.engine.arg_utils",
    "SamplingParams": "pyorch.sampling_params",
    "RequestOutput": "pyorch.outputs",
    "CompletionOutput": "pyorch.outputs",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pyorch' has no attribute {name!r}")
