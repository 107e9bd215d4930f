"""Reference of random_sample_from_logits: Philox4x32-10 in numpy (uint64 products, exact) and
the exponential race's scores in float64 from the same uniform words."""

from __future__ import annotations

import numpy as np
import torch

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0, k1) -> list[np.ndarray]:
    """Ten Philox rounds over uint64 arrays holding 32-bit values; returns the four words."""
    c = [np.asarray(x, dtype=np.uint64) & _MASK for x in (c0, c1, c2, c3)]
    k0 = np.asarray(k0, dtype=np.uint64) & _MASK
    k1 = np.asarray(k1, dtype=np.uint64) & _MASK
    for _ in range(10):
        p0 = _M0 * c[0]
        p1 = _M1 * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0 = (k0 + _W0) & _MASK
        k1 = (k1 + _W1) & _MASK
    return c


def uniform_words(seeds: torch.Tensor, vocab_size: int) -> np.ndarray:
    """[rows, vocab] uint64 words: word j % 4 of Philox(counter (j // 4, 0, 0, 0), key seed)."""
    s = seeds.cpu().numpy().astype(np.int64).view(np.uint64)[:, None]
    groups = np.arange((vocab_size + 3) // 4, dtype=np.uint64)[None, :]
    words = philox4x32_10(groups & _MASK, groups >> np.uint64(32), 0, 0, s & _MASK,
                          s >> np.uint64(32))
    return np.stack(words, axis=-1).reshape(len(s), -1)[:, :vocab_size]


def race_scores(logits: torch.Tensor, temperature: torch.Tensor,
                seeds: torch.Tensor) -> np.ndarray:
    """[rows, vocab] float64: x / t - log(-log(u)); greedy rows (t <= 0) their logits."""
    x = logits.detach().float().cpu().double().numpy()
    t = temperature.cpu().double().numpy()[:, None]
    words = uniform_words(seeds, x.shape[1])
    u = ((words >> np.uint64(9)).astype(np.float64) + 0.5) * 2.0**-23
    with np.errstate(invalid="ignore", divide="ignore"):
        scores = x / np.where(t > 0, t, 1.0) - np.log(-np.log(u))
    return np.where(t > 0, scores, x)
