"""Your own images: ``root/train/<class>/*.jpg`` and ``root/val/<class>/*.jpg`` (torchvision ImageFolder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchvision import datasets, transforms

from lightning_solo.app.data.base import ImageDataModule

_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class ImageFolderDataModule(ImageDataModule):
    def __init__(self, root: str, num_classes: int | None = None, image_size: int = 224, **loader: Any) -> None:
        loader.setdefault("batch_size", 64)
        super().__init__(**loader)
        self.root = Path(root).expanduser().resolve()
        self.image_size = image_size
        found = len(self._classes(self.root / "train"))
        if num_classes is not None and num_classes != found:
            raise ValueError(f"num_classes={num_classes} but {self.root / 'train'} has {found} class folders")
        self.num_classes = found

    @staticmethod
    def _classes(split_dir: Path) -> list[str]:
        if not split_dir.is_dir():
            raise FileNotFoundError(
                f"image folder split not found: {split_dir}. Expected {split_dir}/<class_name>/<image files>; "
                "set `data.root=...` to a folder that has train/ and val/."
            )
        classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
        if not classes:
            raise FileNotFoundError(f"{split_dir} has no class sub-folders")
        return classes

    def setup(self, stage: str | None = None) -> None:
        norm = [transforms.ToTensor(), transforms.Normalize(_IMAGENET_MEAN, _IMAGENET_STD)]
        train_tf = [transforms.RandomResizedCrop(self.image_size), transforms.RandomHorizontalFlip()]
        val_tf = [transforms.Resize(int(self.image_size * 1.14)), transforms.CenterCrop(self.image_size)]
        self._classes(self.root / "val")
        self.train_set = datasets.ImageFolder(self.root / "train", transforms.Compose(train_tf + norm))
        self.val_set = datasets.ImageFolder(self.root / "val", transforms.Compose(val_tf + norm))
