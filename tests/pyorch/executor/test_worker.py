"""A CPU worker's thread count: an equal share of the host's cores per rank, or the user's
OMP_NUM_THREADS."""

import os

import pytest

from pyorch.executor.worker import cpu_threads


@pytest.mark.parametrize("cores,world_size,expected", [(2, 1, 2), (2, 2, 1), (2, 4, 1),
                                                       (16, 4, 4), (7, 2, 3), (None, 1, 1)])
def test_ranks_share_the_cores(monkeypatch, cores, world_size, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert cpu_threads(world_size) == expected


def test_omp_num_threads_is_the_users_choice(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert cpu_threads(1) is None  # torch has read OMP_NUM_THREADS; the worker leaves it
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert cpu_threads(2) == 8
