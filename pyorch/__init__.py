"""pyorch: a high-throughput, memory-efficient LLM inference and serving engine."""

import torch  # noqa: F401  (loads libtorch before the extension)

from pyorch import _C  # noqa: F401  (registers torch.ops.pyorch.*)

__version__ = "0.1.0"
