"""Which rows of an evaluation batch are real, under Lightning's own evaluation samplers. See docs/evaluation.md."""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from lightning_solo._compat import lightning as lightning_compat

# sampler -> (epoch, indices, valid), read once per epoch; nothing set on the sampler, nothing kept after it
_ORDERS: weakref.WeakKeyDictionary[Any, tuple[Any, list[int], list[bool]]] = weakref.WeakKeyDictionary()
_LOADERS = {RunningStage.VALIDATING: "val_dataloaders", RunningStage.SANITY_CHECKING: "val_dataloaders",
            RunningStage.TESTING: "test_dataloaders", RunningStage.PREDICTING: "predict_dataloaders"}  # fmt: skip


class EvalRows(NamedTuple):
    """The rows of one evaluation batch: their dataset ``indices`` and which are ``valid`` (False: a repeat)."""

    indices: torch.Tensor
    valid: torch.Tensor

    @property
    def padded(self) -> bool:
        return not bool(self.valid.all())


def rank_order(sampler: Any) -> tuple[list[int], list[bool]] | None:
    """This rank's indices in evaluation order and which are real (False: padding repeats); ``None``: other samplers."""
    if not isinstance(sampler, (DistributedSampler, SequentialSampler)):
        return None
    epoch = getattr(sampler, "epoch", 0)
    if (cached := _ORDERS.get(sampler)) is not None and cached[0] == epoch:
        return cached[1], cached[2]
    indices = [int(i) for i in sampler]
    if isinstance(sampler, (UnrepeatedDistributedSamplerWrapper, SequentialSampler)):
        valid = [True] * len(indices)
    else:
        # DistributedSampler pads the dataset order to W·ceil(N/W) and gives rank r positions r, r+W, ...
        # (DistributedSamplerWrapper: N is the user's sampler's length, the indices are what it yields).
        total = len(sampler.dataset)  # type: ignore[arg-type]  # sized: DistributedSampler took its len too
        valid = [sampler.rank + k * sampler.num_replicas < total for k in range(len(indices))]
    _ORDERS[sampler] = (epoch, indices, valid)
    return indices, valid


def eval_rows(trainer: Any, batch_idx: int, dataloader_idx: int = 0) -> EvalRows | None:
    """The dataset indices and validity of the current evaluation batch ``batch_idx``; ``None`` when unknowable."""
    attribute = _LOADERS.get(trainer.state.stage)
    iterables = getattr(trainer, attribute) if attribute else None
    if iterables is None:
        return None
    flattened = CombinedLoader(iterables).flattened
    loader = flattened[dataloader_idx] if dataloader_idx < len(flattened) else None
    batch_sampler = lightning_compat.inner_batch_sampler(getattr(loader, "batch_sampler", None))
    if type(batch_sampler) is not BatchSampler or (order := rank_order(batch_sampler.sampler)) is None:
        return None
    indices, valid = order
    size = batch_sampler.batch_size
    start, stop = batch_idx * size, min((batch_idx + 1) * size, len(indices))
    return EvalRows(
        torch.tensor(indices[start:stop], dtype=torch.long), torch.tensor(valid[start:stop], dtype=torch.bool)
    )
