"""Handwritten digits (1,797 real 8×8 grey images, 10 classes): the offline default data. See docs/runner.md."""

from __future__ import annotations

import gzip
import math
from importlib.resources import files
from typing import Any

import torch
from torch.utils.data import TensorDataset

from lightning_solo.app.data.base import ImageDataModule
from lightning_solo.core.checks import check_int

# the whole set's pixel (0..16) mean and standard deviation: the normalisation does not depend on the split
_MEAN, _STD = 4.88, 6.02


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1,797 images as ``(N, 64)`` float pixel values 0..16, and their labels ``(N,)``."""
    text = gzip.decompress(files(__package__).joinpath("optdigits.tes.gz").read_bytes()).decode()
    rows = torch.tensor([[int(v) for v in line.split(",")] for line in text.splitlines()])
    return rows[:, :64].float(), rows[:, 64]


def stratified_split(labels: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted indices ``(train, val)``: ``ceil(val_fraction * N)`` held out, each class in proportion (largest
    remainders round up), drawn by a generator seeded with ``seed`` alone."""
    n_val = math.ceil(val_fraction * len(labels))
    classes, counts = labels.unique(return_counts=True)
    quota = counts * n_val / len(labels)
    take = quota.floor().long()
    take[torch.argsort(quota - take, descending=True, stable=True)[: n_val - int(take.sum())]] += 1
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    val = torch.cat([order[labels[order] == c][:k] for c, k in zip(classes, take.tolist())]).sort().values
    held_out = torch.zeros(len(labels), dtype=torch.bool)
    held_out[val] = True
    return (~held_out).nonzero().flatten(), val


class DigitsDataModule(ImageDataModule):
    """Train/val ``TensorDataset`` s of the digits, ``(1, 8, 8)`` and standardised; ``batch_size`` is per device."""

    num_classes = 10
    channels = 1
    image_size = 8

    def __init__(self, val_fraction: float = 0.2, split_seed: int = 0, num_classes: int = 10, **loader: Any) -> None:
        super().__init__(**loader)
        if num_classes != 10:
            raise ValueError(f"the digits data has 10 classes, got num_classes={num_classes!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        self.val_fraction = val_fraction
        self.split_seed = check_int("split_seed", split_seed, minimum=0)

    def setup(self, stage: str | None = None) -> None:
        pixels, y = load_digits()
        x = ((pixels - _MEAN) / _STD).view(-1, 1, 8, 8)
        train_idx, val_idx = stratified_split(y, self.val_fraction, self.split_seed)
        self.train_set = TensorDataset(x[train_idx], y[train_idx])
        self.val_set = TensorDataset(x[val_idx], y[val_idx])
