"""Datamodules: a learnable synthetic image set (the offline default), CIFAR-10 and an image folder."""

from lightning_solo.data.cifar import CIFAR10DataModule
from lightning_solo.data.folder import ImageFolderDataModule
from lightning_solo.data.synthetic import SyntheticDataModule, SyntheticImages

__all__ = ["CIFAR10DataModule", "ImageFolderDataModule", "SyntheticDataModule", "SyntheticImages"]
