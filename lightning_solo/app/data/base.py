"""What every image datamodule here shares: per-device batch size, loaders, and their validation."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader, Dataset

from lightning_solo.core.checks import check_int


class ImageDataModule(L.LightningDataModule):
    """Base: subclasses set ``num_classes``, fill ``train_set``/``val_set`` (``test_set``: ``val_set`` unless set)
    in ``setup`` and forward ``**loader`` here. ``batch_size`` is per device; Lightning adds the sampler."""

    num_classes: int

    def __init__(
        self, batch_size: int = 32, num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int | None = None
    ) -> None:
        super().__init__()
        self.batch_size = check_int("batch_size", batch_size)
        self.num_workers = check_int("num_workers", num_workers, minimum=0)
        self.pin_memory = pin_memory
        self.prefetch_factor = check_int("prefetch_factor", prefetch_factor, optional=True)  # per worker
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        assert dataset is not None, "setup() has not run"
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,  # torch's default: 2
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set if self.test_set is not None else self.val_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()
