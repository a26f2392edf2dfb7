"""Datamodules: handwritten digits (the offline default, shipped here), a learnable synthetic image set, CIFAR-10 and an
image folder."""

from lightning_solo.app.data.cifar import CIFAR10DataModule
from lightning_solo.app.data.digits import DigitsDataModule
from lightning_solo.app.data.folder import ImageFolderDataModule
from lightning_solo.app.data.synthetic import SyntheticDataModule, SyntheticImages

__all__ = ["CIFAR10DataModule", "DigitsDataModule", "ImageFolderDataModule", "SyntheticDataModule", "SyntheticImages"]
