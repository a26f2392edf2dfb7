"""Warnings, each with its fix, about a training setup that works but wastes the devices. See docs/diagnostics.md."""

from __future__ import annotations

import os
from dataclasses import dataclass

import lightning.pytorch as pl
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_solo._compat.torch import BatchNormBase
from lightning_solo.core.batch_size import per_device_batch_size
from lightning_solo.ddp.strategy import SoloDDP
from lightning_solo.ddp.syncbn import SoloSyncBatchNorm
from lightning_solo.diagnostics.checks.finding import Finding


@dataclass(frozen=True)
class TrainingSetup:
    """What the rules look at. ``None``: unknown (a loader that is not a ``DataLoader``, say); its rule is skipped."""

    device_type: str = "cpu"
    world_size: int = 1
    cores_per_process: int = 1
    per_device_batch: int | None = None
    num_workers: int | None = None
    pin_memory: bool | None = None
    map_style: bool | None = None
    sharded: bool | None = None
    data_parallel: tuple[str, ...] = ()
    unsynced_batchnorm: int = 0
    sync_batchnorm_threshold: int = 32
    min_gpu_batch: int = 16


def check_setup(s: TrainingSetup) -> list[Finding]:
    """The warnings, each with its fix, that ``s`` calls for."""
    found: list[Finding] = []

    def warn(check: str, message: str) -> None:
        found.append(Finding(check, message))

    if s.data_parallel:
        warn(
            "model.data_parallel",
            f"nn.DataParallel inside the model ({', '.join(s.data_parallel)}): under DDP every process would "
            "split each batch again over all the GPUs it sees, from one Python thread. Remove the wrapper; "
            "SoloDDP already runs one process per device.",
        )
    if s.num_workers == 0 and s.cores_per_process >= 2:
        workers = min(8, s.cores_per_process - 1 if s.device_type == "cuda" else s.cores_per_process // 2)
        warn(
            "loader.num_workers",
            f"num_workers=0 loads every batch in the training process while {s.cores_per_process} cores per "
            f"process are there: set DataLoader(num_workers={workers}).",
        )
    if s.world_size > 1 and s.map_style and s.sharded is False:
        warn(
            "loader.sampler",
            f"the training loader's sampler does not split the dataset between the {s.world_size} ranks: each "
            "rank trains on the whole dataset, so an epoch is world-size times the work. Leave "
            "Trainer(use_distributed_sampler=True), or give the loader a DistributedSampler.",
        )
    small = s.per_device_batch is not None and s.per_device_batch < s.sync_batchnorm_threshold
    if s.world_size > 1 and s.unsynced_batchnorm and small:
        warn(
            "model.batchnorm",
            f"{s.unsynced_batchnorm} BatchNorm layer(s) normalise over a per-device batch of "
            f"{s.per_device_batch} (< {s.sync_batchnorm_threshold}) without synchronisation: noisy statistics. "
            "Set SoloDDP(sync_batchnorm='auto') or SoloDDP(sync_batchnorm=True).",
        )
    if s.device_type == "cuda" and s.pin_memory is False:
        warn(
            "loader.pin_memory",
            "pin_memory is off on GPU: host-to-device copies cannot overlap compute. Set DataLoader(pin_memory=True).",
        )
    if s.device_type == "cuda" and s.per_device_batch is not None and s.per_device_batch < s.min_gpu_batch:
        warn(
            "loader.batch_size",
            f"a per-device batch of {s.per_device_batch} is too small to keep a GPU busy: launch and "
            f"all-reduce overheads dominate each step. Raise DataLoader(batch_size={s.min_gpu_batch}) and "
            "lower Trainer(accumulate_grad_batches=...) to keep the global batch.",
        )
    return found


def read_setup(trainer: pl.Trainer, min_gpu_batch: int = 16) -> TrainingSetup:
    """The :class:`TrainingSetup` of a running fit (after the train loader is loaded)."""
    model = trainer.lightning_module
    loader = trainer.train_dataloader
    loader = loader if isinstance(loader, DataLoader) else None
    return TrainingSetup(
        device_type=trainer.strategy.root_device.type,
        world_size=trainer.world_size,
        cores_per_process=cores_per_process(trainer.num_devices),
        per_device_batch=per_device_batch_size(trainer),
        num_workers=loader.num_workers if loader is not None else None,
        pin_memory=loader.pin_memory if loader is not None else None,
        map_style=not isinstance(loader.dataset, IterableDataset) if loader is not None else None,
        sharded=(_sharded(loader.sampler) or _sharded(loader.batch_sampler)) if loader is not None else None,
        data_parallel=tuple(n or "the model" for n, m in model.named_modules() if isinstance(m, nn.DataParallel)),
        unsynced_batchnorm=sum(
            isinstance(m, BatchNormBase) and not isinstance(m, (nn.SyncBatchNorm, SoloSyncBatchNorm))
            for m in model.modules()
        ),
        sync_batchnorm_threshold=trainer.strategy.sync_batchnorm_threshold
        if isinstance(trainer.strategy, SoloDDP)
        else TrainingSetup.sync_batchnorm_threshold,
        min_gpu_batch=min_gpu_batch,
    )


def cores_per_process(local_processes: int) -> int:
    """This node's cores (the process's affinity) per local process, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, local_processes))


def _sharded(sampler) -> bool:
    """A sampler, or one it wraps (``.sampler``), that splits by rank (has ``num_replicas`` and ``rank``)."""
    seen = 0
    while sampler is not None and seen < 8:
        if isinstance(sampler, DistributedSampler) or (hasattr(sampler, "num_replicas") and hasattr(sampler, "rank")):
            return True
        sampler, seen = getattr(sampler, "sampler", None), seen + 1
    return False
