"""Pooling models' parameters (vLLM's `PoolingParams`, `PoolerConfig`), torch-free.

A pooling request runs its prompt through the model once (prefill only, no sampling) and returns
the pooled final hidden states:
- `PoolerConfig` is the engine-wide choice (`--pooler-config`, `LLM(pooler_config=...)`): how to
  pool (`pooling_type`: LAST, MEAN, CLS for one vector per prompt; ALL for one per token) and
  the defaults of `normalize` and `dimensions`.
- `PoolingParams` is per request: the task (`embed`: one vector; `token_embed`: one per token),
  `normalize` and `dimensions` (matryoshka truncation), each None to take the config's value.

Both sides of the engine-core wire import this module (plain dicts cross it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
SEQ_POOLING_TYPES = ("LAST", "MEAN", "CLS")
# vLLM's PoolingTask names that pyorch implements; classify/token_classify need a head we lack.
POOLING_TASKS = ("embed", "token_embed")


def _check_dimensions(value: Any, what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ValueError(f"{what} must be a positive integer, got {value!r}")


def _check_normalize(value: Any, what: str) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{what} must be a bool, got {value!r}")


@dataclass
class PoolerConfig:
    """Controls output pooling (vLLM's `PoolerConfig`; the fields pyorch implements).

    pooling_type: "LAST" | "MEAN" | "CLS" | "ALL" (case-insensitive); None is the model's default
        (LAST for the decoder models converted to embedding models, as vLLM).
    normalize: L2-normalize the pooled vectors (None: True, vLLM's embedding default).
    dimensions: default matryoshka dimensions (only for models whose config says they are
        matryoshka models).
    """

    pooling_type: Optional[str] = None
    normalize: Optional[bool] = None
    dimensions: Optional[int] = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or (
                    self.pooling_type.upper() not in POOLING_TYPES):
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                                 f"{self.pooling_type!r}")
            self.pooling_type = self.pooling_type.upper()
        _check_normalize(self.normalize, "PoolerConfig.normalize")
        _check_dimensions(self.dimensions, "PoolerConfig.dimensions")

    @classmethod
    def from_value(cls, value: Any) -> Optional[PoolerConfig]:
        """A PoolerConfig from itself, a dict of its fields, or None (ValueError naming an
        unknown field)."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a PoolerConfig or a dict, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"pooler_config fields not supported by pyorch: {unknown} "
                             f"(supported: {sorted(known)})")
        return cls(**value)


@dataclass
class PoolingParams:
    """Per-request pooling parameters (vLLM's names).

    task: "embed" (one vector per prompt, the config's pooling) or "token_embed" (one vector
        per prompt token); None: set by the entry point (`embed` for `LLM.embed`).
    normalize: L2-normalize the output (None: the PoolerConfig's default, True).
    dimensions: keep the first `dimensions` values (matryoshka models only), before normalizing.
    """

    task: Optional[str] = None
    normalize: Optional[bool] = None
    dimensions: Optional[int] = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {', '.join(POOLING_TASKS)}, got "
                             f"{self.task!r}")
        _check_normalize(self.normalize, "normalize")
        _check_dimensions(self.dimensions, "dimensions")

    def clone(self) -> PoolingParams:
        return PoolingParams(self.task, self.normalize, self.dimensions)

    def resolve(self, config: PoolerConfig, hidden_size: int, hf_config: Any) -> PoolingParams:
        """A copy with every field decided (the config's defaults filled in, the task set), or
        ValueError for dimensions the model cannot give (vLLM's matryoshka rules)."""
        task = self.task or ("token_embed" if config.pooling_type == "ALL" else "embed")
        if task == "embed" and config.pooling_type == "ALL":
            raise ValueError("this model pools with pooling_type ALL (one vector per token): "
                             "task 'embed' (embeddings, scores) needs LAST, MEAN or CLS pooling")
        normalize = config.normalize if self.normalize is None else self.normalize
        dimensions = config.dimensions if self.dimensions is None else self.dimensions
        if dimensions is not None:
            check_matryoshka(dimensions, hidden_size, hf_config)
        return PoolingParams(task, True if normalize is None else normalize, dimensions)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolingParams:
        return cls(**d)


def check_matryoshka(dimensions: int, hidden_size: int, hf_config: Any) -> None:
    """vLLM's rules for `dimensions`: the model must be a matryoshka model (`is_matryoshka` or
    `matryoshka_dimensions` in its config), and the value one it lists (if it lists any)."""
    listed = getattr(hf_config, "matryoshka_dimensions", None)
    if not getattr(hf_config, "is_matryoshka", False) and not listed:
        raise ValueError(f"Model \"{getattr(hf_config, '_name_or_path', '') or 'this model'}\" "
                         "does not support matryoshka representation, changing output "
                         "dimensions will lead to poor results.")
    if listed and dimensions not in listed:
        raise ValueError(f"Model \"{getattr(hf_config, '_name_or_path', '') or 'this model'}\" "
                         f"only supports {list(listed)} matryoshka dimensions, use other "
                         "output dimensions will lead to poor results.")
    if dimensions > hidden_size:
        raise ValueError(f"dimensions={dimensions} is larger than the model's hidden size "
                         f"({hidden_size})")
