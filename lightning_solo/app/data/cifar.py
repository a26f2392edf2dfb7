"""CIFAR-10 through torchvision. Nothing is downloaded unless ``download=True``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchvision import datasets, transforms

from lightning_solo.app.data.base import ImageDataModule

_MEAN, _STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class CIFAR10DataModule(ImageDataModule):
    num_classes = 10

    def __init__(
        self,
        root: str = "data/cifar10",
        download: bool = False,
        augment: bool = True,
        num_classes: int = 10,
        **loader: Any,
    ) -> None:
        loader.setdefault("batch_size", 128)
        super().__init__(**loader)
        if num_classes != 10:
            raise ValueError(f"CIFAR-10 has 10 classes, got num_classes={num_classes!r}")
        self.root = Path(root).expanduser().resolve()
        self.download = download
        self.augment = augment

    def prepare_data(self) -> None:
        if self.download:
            datasets.CIFAR10(self.root, train=True, download=True)
            datasets.CIFAR10(self.root, train=False, download=True)

    def setup(self, stage: str | None = None) -> None:
        normalize = [transforms.ToTensor(), transforms.Normalize(_MEAN, _STD)]
        train_tf = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if self.augment else []
        try:
            self.train_set = datasets.CIFAR10(self.root, train=True, transform=transforms.Compose(train_tf + normalize))
            self.val_set = datasets.CIFAR10(self.root, train=False, transform=transforms.Compose(normalize))
        except RuntimeError as err:  # torchvision: "Dataset not found or corrupted."
            raise FileNotFoundError(
                f"CIFAR-10 not found in {self.root} (expected {self.root / 'cifar-10-batches-py'}). "
                "Download it once with `data.download=true`, or point `data.root=...` at an existing copy."
            ) from err
