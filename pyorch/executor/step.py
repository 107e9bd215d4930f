"""What a step hands back: the handle of a launched step (its sampled tokens on their way to the
host) and the runner's output once they arrived."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from pyorch.core_types import LogprobsLists
from pyorch.layers.sampler import LogprobsTensors


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[Optional[LogprobsLists]] = field(default_factory=list)  # one row per request
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # this step's chunk
    # Pooling requests whose prompt finished this step: req_id -> float32 array (core_types).
    pooled: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class StepHandle:
    """A launched step: which rows sample, and their tokens on their way to the host.

    The sampled ids stay on the device too (`sampled_device`), where the next step reads the
    inputs of requests scheduled before these tokens reached the host."""

    req_ids: list[str]
    sampled_rows: list[int]  # rows of req_ids that sample, in sampler order
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    sampled_device: Optional[torch.Tensor] = None  # [len(sampled_rows)] int64
    sampled_row_of: dict[str, int] = field(default_factory=dict)  # req_id -> sampler row
    trace: Optional[dict[str, Any]] = None  # StepTimings.trace record in the making
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # req_id -> pooled (device)
    _host_tokens: Optional[torch.Tensor] = None
    _host_logprobs: Optional[LogprobsTensors] = None
    _event: Optional[torch.cuda.Event] = None

    def to_host(self, tokens: torch.Tensor, logprobs: Optional[LogprobsTensors]) -> None:
        """Starts the device -> host copies (pinned, non-blocking) and marks their end."""
        if tokens.device.type != "cuda":
            self._host_tokens, self._host_logprobs = tokens, logprobs
            return
        self._host_tokens = _pinned_copy(tokens)
        if logprobs is not None:
            self._host_logprobs = LogprobsTensors(*(_pinned_copy(t) for t in logprobs))
        self._event = torch.cuda.Event()
        self._event.record()

    def pooled_to_host(self) -> dict[str, np.ndarray]:
        """The pooled outputs as float32 numpy arrays (a device sync when there are any)."""
        return {req_id: t.detach().to("cpu", torch.float32).numpy()
                for req_id, t in self.pooled.items()}

    def wait(self) -> tuple[list[int], Optional[LogprobsLists]]:
        """The sampled token ids (and logprobs), once the copies landed."""
        if self._event is not None:
            self._event.synchronize()  # the step's one wait on the device
        if self._host_tokens is None:
            raise RuntimeError("StepHandle.wait() called before to_host()")
        tokens = self._host_tokens.tolist()
        entries = self._host_logprobs.tolists() if self._host_logprobs is not None else None
        return tokens, entries


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
