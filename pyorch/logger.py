"""Logging set-up for pyorch's entry points (the CLI, the server and the engine-core process)."""

from __future__ import annotations

import logging

from pyorch import envs

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging(process_name: str = "") -> None:
    """pyorch's loggers on stderr at PYORCH_LOGGING_LEVEL (default INFO), as vLLM prints its
    model-load, KV-capacity and CUDA-graph lines. Idempotent: a second call only sets the level.

    process_name: prefixed to each line (the engine-core process passes "engine-core").
    """
    pyorch_logger = logging.getLogger("pyorch")
    if not pyorch_logger.handlers:
        handler = logging.StreamHandler()
        prefix = f"{process_name} " if process_name else ""
        handler.setFormatter(logging.Formatter(prefix + _FORMAT, _DATE_FORMAT))
        pyorch_logger.addHandler(handler)
    pyorch_logger.setLevel(envs.PYORCH_LOGGING_LEVEL)
