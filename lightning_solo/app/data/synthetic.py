"""A learnable synthetic image classification set, generated in-process (no download, any size). See docs/runner.md."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from lightning_solo.app.data.base import ImageDataModule
from lightning_solo.core.checks import check_int


class SyntheticImages(Dataset):
    """``length`` images ``(channels, image_size, image_size)``; item ``i`` a pure function of ``(seed, i)``."""

    def __init__(
        self,
        length: int,
        num_classes: int = 10,
        image_size: int = 32,
        channels: int = 3,
        noise: float = 1.5,
        seed: int = 0,
        split_offset: int = 0,
    ) -> None:
        self.length = check_int("length", length)
        self.num_classes = check_int("num_classes", num_classes)
        self.image_size = check_int("image_size", image_size)
        self.channels = check_int("channels", channels)
        if noise < 0:
            raise ValueError(f"noise must be >= 0, got {noise!r}")
        self.noise = noise
        self.seed = seed
        self.split_offset = split_offset
        gen = torch.Generator().manual_seed(seed)
        coarse = torch.randn(num_classes, channels, 4, 4, generator=gen)
        templates = F.interpolate(coarse, size=(image_size, image_size), mode="bicubic", align_corners=False)
        self.templates = templates / templates.flatten(1).std(dim=1).view(-1, 1, 1, 1)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.split_offset + index)
        label = int(torch.randint(self.num_classes, (1,), generator=gen))
        shift = torch.randint(-2, 3, (2,), generator=gen).tolist()
        gain = 0.75 + 0.5 * torch.rand(1, generator=gen).item()
        image = torch.roll(self.templates[label], shifts=shift, dims=(1, 2)) * gain
        image = image + self.noise * torch.randn(image.shape, generator=gen)
        return image, label


class SyntheticDataModule(ImageDataModule):
    """Train/val splits of :class:`SyntheticImages` (disjoint sample seeds, same class templates)."""

    def __init__(
        self,
        num_classes: int = 10,
        image_size: int = 32,
        channels: int = 3,
        train_size: int = 4096,
        val_size: int = 1024,
        noise: float = 1.5,
        seed: int = 0,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.num_classes = check_int("num_classes", num_classes)
        self.image_size = image_size
        self._kwargs: dict[str, Any] = dict(
            num_classes=num_classes, image_size=image_size, channels=channels, noise=noise, seed=seed
        )
        self.train_size = check_int("train_size", train_size)
        self.val_size = check_int("val_size", val_size)

    def setup(self, stage: str | None = None) -> None:
        self.train_set = SyntheticImages(self.train_size, **self._kwargs)
        self.val_set = SyntheticImages(self.val_size, split_offset=self.train_size, **self._kwargs)
