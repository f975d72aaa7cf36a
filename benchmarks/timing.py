"""Timing a callable: one run, or the median of repeated runs after a warm-up."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def seconds(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], repeats: int,
                   sync: Callable[[], None] = lambda: None, calls: int = 1) -> float:
    """Median over `repeats` of the seconds per call of `calls` back-to-back calls, after
    one untimed call (solver storage, kernels, library handles). `sync` runs before and
    after each repeat: a barrier of the ranks, or the GPU's queue drained."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)
