"""The per-device and global batch size, read (and written by ``auto_batch_size``) one way for everyone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import CombinedLoader
from torch import nn
from torch.utils.data import DataLoader

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.core.checks import is_int
from lightning_solo.core.decision import Decision


def loader_batch_size(loader: Any) -> int | None:
    """The batch size a train loader feeds each device (of several loaders, the smallest); ``None`` if none says."""
    if isinstance(loader, CombinedLoader):
        loader = loader.flattened
    if isinstance(loader, DataLoader):
        if loader.batch_size is not None:
            return loader.batch_size
        return getattr(loader.batch_sampler, "batch_size", None)
    if isinstance(loader, Mapping):
        loader = list(loader.values())
    if isinstance(loader, Sequence) and not isinstance(loader, str):
        sizes = [s for s in map(loader_batch_size, loader) if s is not None]
        return min(sizes) if sizes else None
    size = getattr(loader, "batch_size", None)  # e.g. a CombinedLoader-like wrapper
    return size if is_int(size) else None


def _declared_batch_size(obj: Any) -> int | None:
    size = getattr(obj, "batch_size", None)
    if size is None:
        hparams = getattr(obj, "hparams", None)
        size = hparams.get("batch_size") if isinstance(hparams, Mapping) else None
    return size if is_int(size) else None


def per_device_batch_size(trainer: pl.Trainer, given: int | None = None) -> int | None:
    """The train loader's batch size as known at the strategy's setup: a loaded loader's, one passed to ``fit``,
    else ``given``, else ``batch_size`` on the datamodule or LightningModule (attribute or hparam), else ``None``."""
    loaded = loader_batch_size(trainer.train_dataloader)
    if loaded is not None:
        return loaded
    source = lightning_compat.fit_data_source(trainer)
    # a pre-batched loader passed to fit has none: the user's word then
    if not isinstance(source, (nn.Module, LightningDataModule)) and (loaded := loader_batch_size(source)) is not None:
        return loaded
    if given is not None:
        return given
    datamodule = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
    for owner in (datamodule, trainer.lightning_module):
        if (size := _declared_batch_size(owner)) is not None:
            return size
    return None


@dataclass(frozen=True)
class GlobalBatch:
    """Samples per optimizer step over all ranks: per device × devices × nodes × accumulation steps."""

    per_device: int
    world_size: int
    num_nodes: int
    accumulate: int

    @property
    def size(self) -> int:
        return self.per_device * self.world_size * self.accumulate

    def decision(self, setting: str) -> Decision:
        devices = self.world_size // max(1, self.num_nodes)
        return Decision(
            setting,
            self.size,
            f"{self.per_device} per device × {devices} devices × {self.num_nodes} nodes "
            f"× {self.accumulate} accumulation steps",
        )


def global_batch(trainer: pl.Trainer, given_per_device: int | None = None) -> GlobalBatch | None:
    """The run's global batch; ``None`` when the per-device batch is unknown (:func:`per_device_batch_size`)."""
    per_device = per_device_batch_size(trainer, given_per_device)
    if per_device is None:
        return None
    return GlobalBatch(per_device, trainer.world_size, trainer.num_nodes, trainer.accumulate_grad_batches)


def set_per_device_batch_size(trainer: pl.Trainer, value: int) -> None:
    """Set ``batch_size`` on the datamodule and LightningModule (``lightning_setattr``) to ``value``; raises
    ``ValueError`` where there is none, or when loaders were passed to ``fit`` built already."""
    from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

    source = lightning_compat.fit_data_source(trainer)
    if source is not None and not isinstance(source, (nn.Module, LightningDataModule)):
        raise ValueError("the train loader was passed to fit() ready-made: its batch size cannot be changed")
    model = trainer.lightning_module
    if not lightning_hasattr(model, "batch_size"):
        raise ValueError("neither the datamodule nor the LightningModule has a `batch_size` to set")
    lightning_setattr(model, "batch_size", value)
