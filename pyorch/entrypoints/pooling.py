"""What the offline `LLM.score` and the server's /score and /rerank share: vLLM's pairing of
the two inputs and the bi-encoder score (cosine similarity of two embeddings)."""

from __future__ import annotations

from typing import TypeVar

import numpy as np

T = TypeVar("T")


def pair_up(data_1: list[T], data_2: list[T]) -> tuple[list[T], list[T]]:
    """vLLM's score pairing: 1 -> 1, 1 -> N (the one is repeated) or N -> N; ValueError
    otherwise."""
    if not data_1 or not data_2:
        raise ValueError("score needs at least one input on each side")
    if len(data_1) == 1:
        return data_1 * len(data_2), list(data_2)
    if len(data_1) != len(data_2):
        raise ValueError(f"Input lengths must be either 1:1, 1:N or N:N, got {len(data_1)} and "
                         f"{len(data_2)}")
    return list(data_1), list(data_2)


def cosine_scores(a: list[list[float]], b: list[list[float]]) -> list[float]:
    """Row-wise cosine similarity of two lists of vectors (float64 math, as Python floats)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    num = (x * y).sum(axis=1)
    den = np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)
    # A zero vector has no direction: its similarity to anything is 0 (not NaN).
    with np.errstate(invalid="ignore", divide="ignore"):
        scores = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
    return [float(s) for s in scores]
