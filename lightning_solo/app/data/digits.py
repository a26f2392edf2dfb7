"""scikit-learn's handwritten digits (1,797 real 8×8 grey images, 10 classes): the offline default data.

The images ship inside the scikit-learn wheel, so nothing is downloaded. The held-out split is stratified and
fixed by ``split_seed`` alone (not the run's seed), so every run, rank and resume validates on the same images.

Example::

    dm = DigitsDataModule(val_fraction=0.2, batch_size=32)   # 1,437 train / 360 val images, 1×8×8
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

from lightning_solo.app.data.base import ImageDataModule
from lightning_solo.core.checks import check_int

# Pixel values are 0..16; the whole set's mean and standard deviation at that scale (fixed constants, so the
# normalisation does not depend on the split).
_MEAN, _STD = 4.88, 6.02


class DigitsDataModule(ImageDataModule):
    """Train/val :class:`~torch.utils.data.TensorDataset` s of ``sklearn.datasets.load_digits`` images,
    shaped ``(1, 8, 8)`` and standardised; ``batch_size`` is per device."""

    num_classes = 10
    channels = 1
    image_size = 8

    def __init__(
        self,
        val_fraction: float = 0.2,
        split_seed: int = 0,
        num_classes: int = 10,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        if num_classes != 10:
            raise ValueError(f"the digits data has 10 classes, got num_classes={num_classes!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        self.val_fraction = val_fraction
        self.split_seed = check_int("split_seed", split_seed, minimum=0)

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        images, labels = load_digits(return_X_y=True)
        x = torch.as_tensor((images - _MEAN) / _STD, dtype=torch.float32).view(-1, 1, 8, 8)
        y = torch.as_tensor(labels, dtype=torch.long)
        train_idx, val_idx = train_test_split(
            torch.arange(len(y)).numpy(),
            test_size=self.val_fraction,
            random_state=self.split_seed,
            stratify=labels,
        )
        self.train_set = TensorDataset(x[train_idx], y[train_idx])
        self.val_set = TensorDataset(x[val_idx], y[val_idx])
