"""Data sets that work offline (digits, peaks, MNIST-1D, the reference manual's topics as
characters) and torchvision's, when installed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


class DataError(RuntimeError):
    """A data set that cannot be loaded here: a missing package or a missing download."""


@dataclass
class Split:
    """Features and labels of a train and a test part."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    classes: int

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def _split(x: Tensor, y: Tensor, test_fraction: float, seed: int, classes: int) -> Split:
    """A stratified split with a fixed seed: the same test set on every rank and run."""
    gen = torch.Generator().manual_seed(seed)
    test_idx, train_idx = [], []
    for label in range(classes):
        idx = torch.nonzero(y == label).flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        cut = int(round(len(idx) * test_fraction))
        test_idx.append(idx[:cut])
        train_idx.append(idx[cut:])
    train = torch.cat(train_idx)[torch.randperm(sum(len(i) for i in train_idx), generator=gen)]
    test = torch.cat(test_idx).sort().values
    return Split(x[train], y[train], x[test], y[test], classes)


def _digits_arrays() -> tuple[Any, Any]:
    """The digits' images (1797, 8, 8) and labels, as numpy arrays.

    Read from the CSV file scikit-learn installs, without importing scikit-learn: its import
    takes about a second, most of a short `mgrit train`'s start on every rank. Where that
    file is not where scikit-learn 1.x keeps it, `load_digits` reads it."""
    import gzip
    import importlib.util
    from pathlib import Path

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        csv = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
        if csv.is_file():
            with gzip.open(csv, "rt") as f:
                table = np.loadtxt(f, delimiter=",")
            if table.shape == (1797, 65):
                return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images, data.target


def digits(test_fraction: float = 0.3, seed: int = 0, dtype: torch.dtype = torch.float32) -> Split:
    """scikit-learn's bundled 8x8 digits (1797 images, no download), scaled to [0, 1], as
    (N, 1, 8, 8), with a fixed stratified train/test split."""
    images, target = _digits_arrays()
    x = torch.tensor(images / 16.0, dtype=dtype)[:, None]
    y = torch.tensor(target, dtype=torch.long)
    return _split(x, y, test_fraction, seed, classes=10)


def peaks_function(x: Tensor, y: Tensor) -> Tensor:
    """MATLAB's peaks surface, the landscape of the peaks classification problem."""
    return (3 * (1 - x) ** 2 * torch.exp(-x ** 2 - (y + 1) ** 2)
            - 10 * (x / 5 - x ** 3 - y ** 5) * torch.exp(-x ** 2 - y ** 2)
            - torch.exp(-(x + 1) ** 2 - y ** 2) / 3)


# class boundaries: the quintiles of the peaks surface over [-3, 3]^2
PEAKS_LEVELS = (-0.3043, 0.0016, 0.1509, 1.3060)


def peaks(samples: int = 5000, test_fraction: float = 0.3, seed: int = 0,
          dtype: torch.dtype = torch.float32) -> Split:
    """The synthetic 'peaks' problem of the layer-parallel training literature: points
    uniform in [-3, 3]^2 (2 features), labelled by which of 5 level bands of the peaks
    surface they fall in. Generated from `seed`: the same data everywhere."""
    gen = torch.Generator().manual_seed(seed)
    points = torch.rand(samples, 2, generator=gen, dtype=torch.float64) * 6 - 3
    height = peaks_function(points[:, 0], points[:, 1])
    labels = torch.bucketize(height, torch.tensor(PEAKS_LEVELS, dtype=torch.float64))
    return _split(points.to(dtype), labels, test_fraction, seed, classes=5)


def mnist1d(samples: int = 5000, test_fraction: float = 0.3, seed: int = 0,
            dtype: torch.dtype = torch.float32) -> Split:
    """MNIST-1D (Greydanus 2020): 40-sample 1-D signals of 10 digit templates, generated
    procedurally by the `mnist1d` package (no download)."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise DataError("the mnist1d data set needs the mnist1d package: "
                        "pip install 'mgrit[mnist1d]'") from None
    args = get_dataset_args()
    args.num_samples = samples
    args.seed = seed
    data = make_dataset(args)
    x = torch.cat([torch.tensor(data["x"]), torch.tensor(data["x_test"])]).to(dtype)
    y = torch.cat([torch.tensor(data["y"]), torch.tensor(data["y_test"])]).long()
    return _split(x, y, test_fraction, seed, classes=10)


TORCHVISION = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "cifar10": "CIFAR10"}
# the image data sets and the (C, H, W) of their images, known before any is loaded (the
# settings check networks against them); and the text data sets, whose examples are
# windows of token ids with a next-token target at every position
IMAGE_SHAPES = {"digits": (1, 8, 8), "mnist": (1, 28, 28), "fashion-mnist": (1, 28, 28),
                "cifar10": (3, 32, 32)}
TEXTS = ("topics",)


def from_torchvision_sets(train: Any, test: Any, classes: int,
                          dtype: torch.dtype = torch.float32) -> Split:
    """A Split from torchvision data set objects (`.data` images, `.targets` labels),
    scaled to [0, 1] and laid out as (N, C, H, W)."""
    def convert(dataset: Any) -> tuple[Tensor, Tensor]:
        images = torch.as_tensor(dataset.data)
        if images.dim() == 3:                       # (N, H, W) grey images
            images = images[:, None]
        elif images.shape[-1] in (1, 3):            # (N, H, W, C) colour images
            images = images.permute(0, 3, 1, 2)
        return images.to(dtype) / 255.0, torch.as_tensor(dataset.targets).long()
    x_train, y_train = convert(train)
    x_test, y_test = convert(test)
    return Split(x_train, y_train, x_test, y_test, classes)


def torchvision_hint(torch_version: str | None = None) -> str:
    """How to install the torchvision release built for this torch without moving torch:
    each torchvision release pins one torch release (torch 2.N goes with torchvision
    0.N+15), and a plain `pip install torchvision` replaces a pinned torch with the one it
    wants (and its CUDA packages)."""
    version = (torch_version or torch.__version__).split("+")[0]
    parts = version.split(".")
    if len(parts) >= 2 and parts[0] == "2" and parts[1].isdigit():
        match = f"0.{int(parts[1]) + 15}.*"
        return (f"install the torchvision built for torch {version} without touching torch: "
                f"pip install --no-deps 'torchvision=={match}' pillow")
    return ("install the torchvision release that matches your torch (see "
            "pytorch.org/get-started/previous-versions) with pip install --no-deps")


def torchvision_dataset(name: str, root: str, download: bool,
                        dtype: torch.dtype = torch.float32) -> Split:
    """MNIST, Fashion-MNIST or CIFAR-10 through torchvision (an optional dependency)."""
    try:
        import torchvision
    except Exception as err:
        raise DataError(f"the {name} data set needs torchvision, which is not installed or "
                        f"does not import beside this torch ({type(err).__name__}: {err}); "
                        f"{torchvision_hint()}, or use digits, peaks or mnist1d") from None
    cls = getattr(torchvision.datasets, TORCHVISION[name])
    try:
        train = cls(root, train=True, download=download)
        test = cls(root, train=False, download=download)
    except Exception as err:
        hint = ("" if download else " (set data.download = true to let torchvision fetch it)")
        raise DataError(f"could not load {name} from {root!r}: {err}{hint}") from None
    return from_torchvision_sets(train, test, classes=10, dtype=dtype)


@dataclass
class Text:
    """A character-level corpus: train and validation text as token ids, and the
    characters the ids stand for."""

    train: Tensor
    validation: Tensor
    vocab: str

    def decode(self, ids: Tensor) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def windows(self, part: str, context: int) -> tuple[Tensor, Tensor]:
        """Non-overlapping windows of `context` tokens of a part ("train" or
        "validation") and their next-token targets: (windows, context) each."""
        ids = self.train if part == "train" else self.validation
        count = (len(ids) - 1) // context
        x = ids[: count * context].view(count, context)
        y = ids[1: count * context + 1].view(count, context)
        return x, y

    def sample(self, batch: int, context: int, generator: torch.Generator
               ) -> tuple[Tensor, Tensor]:
        """`batch` windows of the training text at offsets drawn from `generator`."""
        starts = torch.randint(0, len(self.train) - context - 1, (batch,), generator=generator)
        index = starts[:, None] + torch.arange(context + 1)
        seq = self.train[index]
        return seq[:, :-1], seq[:, 1:]


def topics_text() -> Text:
    """The reference manual topics that ship with Python (`pydoc_data.topics`), as
    characters: the topics sorted by name, the first 90% of each topic's characters (cut
    at floor(0.9 * length)) for training and the rest for validation, each part joined with
    blank lines. The vocabulary is every character of both parts, sorted. The text is that
    of the running Python's version: runs compare on one version."""
    from pydoc_data.topics import topics

    texts = [topics[n] for n in sorted(topics)]
    cuts = [int(0.9 * len(t)) for t in texts]
    train = "\n\n".join(t[:c] for t, c in zip(texts, cuts))
    validation = "\n\n".join(t[c:] for t, c in zip(texts, cuts))
    vocab = "".join(sorted(set(train) | set(validation)))
    index = {c: i for i, c in enumerate(vocab)}

    def encode(text: str) -> Tensor:
        return torch.tensor([index[c] for c in text], dtype=torch.long)
    return Text(encode(train), encode(validation), vocab)


def topics(context: int = 64) -> Split:
    """`topics_text` as a Split of non-overlapping windows of `context` characters (x) and
    their next characters (y), "classes" being the vocabulary size."""
    text = topics_text()
    x_train, y_train = text.windows("train", context)
    x_test, y_test = text.windows("validation", context)
    return Split(x_train, y_train, x_test, y_test, len(text.vocab))


def load(name: str, root: str = "data", download: bool = False, test_fraction: float = 0.3,
         samples: int = 5000, seed: int = 0, context: int = 64) -> Split:
    """The data set of DataSettings by name (`context`: the window of topics)."""
    if name == "topics":
        return topics(context)
    if name == "digits":
        return digits(test_fraction, seed)
    if name == "peaks":
        return peaks(samples, test_fraction, seed)
    if name == "mnist1d":
        return mnist1d(samples, test_fraction, seed)
    if name in TORCHVISION:
        return torchvision_dataset(name, root, download)
    raise ValueError(f"unknown data set {name!r}; choose one of digits, peaks, mnist1d, "
                     f"{', '.join(TORCHVISION)}, topics")


def batches(x: Tensor, y: Tensor, batch_size: int, generator: torch.Generator | None = None):
    """Mini-batches in a shuffled order drawn from `generator` (or in order without one).
    A final short batch is dropped so every batch has the same shape."""
    order = (torch.randperm(len(x), generator=generator) if generator is not None
             else torch.arange(len(x)))
    # drawn on the host (the same order on any device), indexing where the data lie: an
    # index on the host would be copied to a GPU, and waited for, at every batch
    order = order.to(x.device)
    for start in range(0, len(x) - batch_size + 1, batch_size):
        idx = order[start: start + batch_size]
        yield x[idx], y[idx]


def peaks_levels(grid: int = 601) -> list[float]:
    """Quintiles of the peaks surface on a grid over [-3, 3]^2 (how PEAKS_LEVELS was set)."""
    axis = torch.linspace(-3, 3, grid, dtype=torch.float64)
    xx, yy = torch.meshgrid(axis, axis, indexing="ij")
    values = peaks_function(xx, yy).flatten().sort().values
    return [float(values[math.floor(q * (len(values) - 1))]) for q in (0.2, 0.4, 0.6, 0.8)]
