"""Small helpers shared across pyorch (torch-free)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers: the number of size-b blocks that hold a."""
    return -(a // -b)
