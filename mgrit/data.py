"""Data sets that work offline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Split:
    """Features and labels of a train and a test part."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    classes: int


def digits(test_fraction: float = 0.3, seed: int = 0, dtype: torch.dtype = torch.float32) -> Split:
    """scikit-learn's bundled 8x8 digits (1797 images), scaled to [0, 1], as (N, 1, 8, 8),
    with a fixed stratified train/test split."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as err:  # pragma: no cover - scikit-learn is a dependency
        raise ImportError("the digits data set needs scikit-learn (pip install scikit-learn)") from err
    data = load_digits()
    x = torch.tensor(data.images / 16.0, dtype=dtype)[:, None]
    y = torch.tensor(data.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(range(len(y)), test_size=test_fraction,
                                           random_state=seed, stratify=data.target)
    return Split(x[idx_train], y[idx_train], x[idx_test], y[idx_test], classes=10)


def batches(x: Tensor, y: Tensor, batch_size: int, generator: torch.Generator | None = None):
    """Mini-batches in a shuffled order drawn from `generator` (or in order without one).
    A final short batch is dropped so every batch has the same shape."""
    order = (torch.randperm(len(x), generator=generator) if generator is not None
             else torch.arange(len(x)))
    for start in range(0, len(x) - batch_size + 1, batch_size):
        idx = order[start: start + batch_size]
        yield x[idx], y[idx]
