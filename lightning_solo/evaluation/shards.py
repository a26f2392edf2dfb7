"""Exact sharding of an evaluation set: every sample on exactly one rank, every rank the same number of batches.

Stock Lightning pads validate/test shards with repeated samples (``DistributedSampler``) and only warns; an
unpadded sampler gives ranks different numbers of steps, and a per-step collective (``self.log(sync_dist=True)``,
a torchmetrics sync) then hangs. Here rank ``r`` takes one contiguous block of the dataset order in
``K = ceil(N / (W·B))`` batches (full ones, then a smaller tail), so each rank runs ``K`` steps and no sample is
repeated. Only when there are too few samples for ``W·K`` non-empty batches (fewer samples than ranks, or
``B = 1`` with ``N`` not a multiple of ``W``) does a rank get a padded row: a repeat of a real sample that
:func:`eval_rows` marks invalid, for the LightningModule to drop before its loss and metrics.

Example::

    from lightning_solo.evaluation import eval_rows

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        logits = self(x)
        rows = eval_rows(self.trainer, batch_idx, dataloader_idx)   # None outside an exact loader
        if rows is not None and rows.padded:
            keep = rows.valid.to(logits.device)
            logits, y = logits[keep], y[keep]
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True, batch_size=len(y))

``SoloDDP`` (``exact_eval=True``, the default) puts :class:`ExactEvalBatchSampler` into every validate, test
and predict loader (:func:`shard_eval_loader`); the Decision ``exact_eval_<stage>`` says how the set was split.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    Sampler,
    SequentialSampler,
)

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.decision import Decision
from lightning_solo.validate import check_int

# The sampler arguments of a DataLoader, replaced by one batch sampler.
_SAMPLER_ARGS = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
# Lightning's warning that validate/test repeat samples across ranks: not true once the loader is exact.
_PADDING_WARNING = r"Using `DistributedSampler` with the dataloaders\. During `trainer\.(validate|test)\(\)`"


@dataclass(frozen=True)
class Batch:
    """One batch of a rank: ``real`` rows from ``start`` in the dataset order, then ``padded`` repeated rows."""

    start: int
    real: int
    padded: int


def plan_shards(total: int, world_size: int, batch_size: int) -> list[list[Batch]]:
    """Per rank, its batches: contiguous blocks of ``total`` samples (sizes differing by at most one), each cut
    into the same number ``ceil(total / (world_size · batch_size))`` of batches, full ones first; a batch
    that would be empty holds one padded row instead."""
    check_int("total", total, minimum=0)
    check_int("world_size", world_size)
    check_int("batch_size", batch_size)
    steps = math.ceil(total / (world_size * batch_size))
    plan, start = [], 0
    for rank in range(world_size):
        left = total // world_size + (rank < total % world_size)
        batches = []
        for j in range(steps):
            real = max(0, min(batch_size, left - (steps - 1 - j)))  # leave one row for each later batch
            batches.append(Batch(start, real, 0 if real else 1))
            start, left = start + real, left - real
        plan.append(batches)
    return plan


class EvalRows(NamedTuple):
    """The rows of one evaluation batch: their dataset ``indices`` and which are ``valid`` (False: padding)."""

    indices: torch.Tensor
    valid: torch.Tensor

    @property
    def padded(self) -> bool:
        return not bool(self.valid.all())


class ExactEvalBatchSampler(Sampler[list[int]]):
    """This rank's batches of :func:`plan_shards` over ``order`` (the dataset indices in evaluation order)."""

    drop_last = False

    def __init__(self, order: Sequence[int], world_size: int, rank: int, batch_size: int) -> None:
        self.order = order
        self.world_size, self.rank, self.batch_size = world_size, rank, batch_size
        self.plan = plan_shards(len(order), world_size, batch_size)[rank]
        self.num_real = sum(b.real for b in self.plan)
        self.num_padded = sum(b.padded for b in self.plan)

    def _indices(self, batch: Batch) -> list[int]:
        real = [self.order[i] for i in range(batch.start, batch.start + batch.real)]
        # A padded row repeats the sample before it (the first one on a rank that has none of its own).
        return real + [self.order[max(batch.start - 1, 0)]] * batch.padded

    def __iter__(self) -> Iterator[list[int]]:
        return (self._indices(b) for b in self.plan)

    def __len__(self) -> int:
        return len(self.plan)

    def rows(self, batch_idx: int) -> EvalRows:
        batch = self.plan[batch_idx]
        valid = torch.zeros(batch.real + batch.padded, dtype=torch.bool)
        valid[: batch.real] = True
        return EvalRows(torch.tensor(self._indices(batch), dtype=torch.long), valid)


def _evaluation_order(sampler: Any, world_size: int) -> Sequence[int] | None:
    """The dataset indices in the order one process would evaluate them, read off the sampler Lightning
    injected (or the user's sequential one on a single process); ``None`` for a loader left to the user."""
    if isinstance(sampler, (DistributedSamplerWrapper, UnrepeatedDistributedSamplerWrapper)):
        wrapped = sampler.dataset  # the user's sampler as a dataset of indices
        return [wrapped[i] for i in range(len(wrapped))]
    if isinstance(sampler, DistributedSampler):
        return range(len(sampler.dataset))  # type: ignore[arg-type]
    if isinstance(sampler, SequentialSampler) and world_size == 1:
        return range(len(sampler))
    return None


def _rebuild(loader: DataLoader, batch_sampler: Sampler[list[int]]) -> DataLoader:
    """``loader`` with its batches drawn from ``batch_sampler``, every other option kept."""
    if type(loader) is DataLoader:
        names = inspect.signature(DataLoader.__init__).parameters
        options = {n: getattr(loader, n) for n in names if n not in _SAMPLER_ARGS and hasattr(loader, n)}
        return DataLoader(loader.dataset, batch_sampler=batch_sampler, **options)
    # A subclass: re-instantiated the way Lightning injects its own sampler.
    args, kwargs = lightning_compat.dataloader_init_args(loader)
    kwargs.update(sampler=None, batch_sampler=batch_sampler, batch_size=1, shuffle=False, drop_last=False)
    return lightning_compat.reinstantiate(loader, args, kwargs)


def shard_eval_loader(
    loader: Any, world_size: int, rank: int, stage: RunningStage | None
) -> tuple[Any, Decision]:
    """``loader`` re-made around an :class:`ExactEvalBatchSampler` when its order can be read (Lightning's
    injected sampler, or a sequential one on one process); otherwise ``loader`` unchanged. The Decision says
    which, and how the samples were split."""
    name = stage.dataloader_prefix if stage is not None else "eval"
    setting = f"exact_eval_{name}"

    def unchanged(why: str) -> tuple[Any, Decision]:
        return loader, Decision(setting, False, why)

    if not isinstance(loader, DataLoader):
        return unchanged(f"the {name} loader is a {type(loader).__name__}, not a DataLoader: used as given")
    if isinstance(loader.dataset, IterableDataset):
        return unchanged(
            f"the {name} loader reads an IterableDataset, which has no order to split: used as given"
        )
    batch_sampler = lightning_compat.inner_batch_sampler(loader.batch_sampler)
    if isinstance(batch_sampler, ExactEvalBatchSampler):
        return loader, Decision(setting, True, "the loader is already exact")
    if type(batch_sampler) is not BatchSampler:
        return unchanged(f"custom batch sampler {type(batch_sampler).__name__}: used as given")
    order = _evaluation_order(batch_sampler.sampler, world_size)
    if order is None:
        return unchanged(
            f"{type(batch_sampler.sampler).__name__} left by the user (use_distributed_sampler=False): used as given"
        )
    if batch_sampler.drop_last:  # as one process would: the incomplete last batch is not evaluated
        order = order[: len(order) - len(order) % batch_sampler.batch_size]
    exact = ExactEvalBatchSampler(order, world_size, rank, batch_sampler.batch_size)
    if stage == RunningStage.PREDICTING:  # Lightning's predict loop reads the batch indices from this wrapper
        exact = lightning_compat.index_batch_sampler(exact)
    try:
        rebuilt = _rebuild(loader, exact)
    except Exception as err:  # noqa: BLE001 - a loader that cannot be re-made stays as it was
        return unchanged(f"the {type(loader).__name__} could not be re-instantiated ({err}): used as given")
    return rebuilt, decide_eval_sharding(len(order), world_size, batch_sampler.batch_size, setting)


def quiet_padding_warning() -> None:
    """Silence Lightning's warning that validate/test repeat samples across ranks: exact loaders do not. Called
    by ``SoloDDP(exact_eval=True)`` when it is made (the warning comes before the loaders reach the strategy)."""
    warnings.filterwarnings("ignore", message=_PADDING_WARNING)


def decide_eval_sharding(
    total: int, world_size: int, batch_size: int, setting: str = "exact_eval"
) -> Decision:
    """How ``total`` samples are split over ``world_size`` ranks in batches of ``batch_size``, as a Decision."""
    plan = plan_shards(total, world_size, batch_size)
    real = [sum(b.real for b in batches) for batches in plan]
    padded = sum(b.padded for batches in plan for b in batches)
    reason = (
        f"{total} samples, each once: ranks take {'/'.join(map(str, real))} in {len(plan[0])} batches "
        f"(at most {batch_size}) each"
    )
    if padded:
        reason += f"; {padded} padded row(s), flagged invalid by lightning_solo.evaluation.eval_rows"
    return Decision(setting, True, reason)


def eval_rows(trainer: Any, batch_idx: int, dataloader_idx: int = 0) -> EvalRows | None:
    """The dataset indices and validity of the current validate/test/predict batch ``batch_idx``: from the
    exact sampler, or counted off a sequential single-process loader; ``None`` when they cannot be known."""
    loaders = {
        RunningStage.VALIDATING: "val_dataloaders",
        RunningStage.SANITY_CHECKING: "val_dataloaders",
        RunningStage.TESTING: "test_dataloaders",
        RunningStage.PREDICTING: "predict_dataloaders",
    }
    attribute = loaders.get(trainer.state.stage)
    iterables = getattr(trainer, attribute) if attribute else None
    if iterables is None:
        return None
    flattened = CombinedLoader(iterables).flattened
    loader = flattened[dataloader_idx] if dataloader_idx < len(flattened) else None
    batch_sampler = lightning_compat.inner_batch_sampler(getattr(loader, "batch_sampler", None))
    if isinstance(batch_sampler, ExactEvalBatchSampler):
        return batch_sampler.rows(batch_idx)
    if type(batch_sampler) is BatchSampler and isinstance(batch_sampler.sampler, SequentialSampler):
        size = batch_sampler.batch_size
        stop = min((batch_idx + 1) * size, len(batch_sampler.sampler))
        indices = torch.arange(batch_idx * size, stop)
        return EvalRows(indices, torch.ones(len(indices), dtype=torch.bool))
    return None
