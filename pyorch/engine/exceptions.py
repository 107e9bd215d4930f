"""Errors the serving front end raises about the engine (vLLM's names)."""

from __future__ import annotations


class EngineDeadError(Exception):
    """The engine-core process is gone (crashed, killed, failed a step, or shut down).

    Fatal: every pending and later request fails with it; the server should answer 503 and stop.
    """


class EngineGenerateError(Exception):
    """One request failed inside the engine core; the engine itself keeps serving."""
