"""ResumableSampler: resume mid-epoch without repeating or skipping samples, with every rank's RNG back.

Lightning restores the loop counters of a mid-epoch checkpoint but restarts the training dataloader
from the first batch of the epoch (it warns "your dataloader is not resumable"), so the resumed epoch
repeats the batches already trained on and never reaches its last ones; it saves no RNG state either.
SoloDDP closes the gap with the pieces below, so nothing changes for the data modules:

* ``make_resumable`` wraps the training loader's sampler (Lightning's ``DistributedSampler``, whose
  order is a function of seed and epoch) in a :class:`ResumableSampler`;
* ``capture`` (every rank, inside ``trainer.save_checkpoint``) records the sampler epoch, the batches
  of this epoch already trained on and every rank's RNG states into ``checkpoint[RESUME_KEY]``;
* ``plan`` turns that record, after Lightning restored its loops, into "epoch e, skip k batches, then
  restore this rank's RNG", applied at the first index the resumed epoch draws.

Example::

    sampler = ResumableSampler(DistributedSampler(dataset, num_replicas=2, rank=0), batch_size=32)
    sampler.resume_once(epoch=3, skip_samples=5 * 32)      # the next iteration starts at batch 5 of epoch 3
"""

from __future__ import annotations

import itertools
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, SequentialSampler

from lightning_solo.decision import Decision

RESUME_KEY = "lightning_solo.resume"


class ResumableSampler(Sampler):
    """Forwards to ``sampler``; after :meth:`resume_once` its next iteration sets that epoch, runs
    ``on_start`` (the RNG restore) and drops the first ``skip_samples`` indices. ``len`` is unchanged, so
    Lightning's batch counts (and its ``batch_idx``, which continues from the checkpoint) still hold."""

    def __init__(self, sampler: Sampler | Any, batch_size: int) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.epoch = int(getattr(sampler, "epoch", 0))
        self._plan: tuple[int | None, int, Callable[[], None] | None] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def resume_once(self, epoch: int | None, skip_samples: int, on_start: Callable[[], None] | None = None) -> None:
        """Arm the next iteration: ``epoch`` (``None``: keep what Lightning set), skip, RNG restore."""
        self._plan = (epoch, skip_samples, on_start)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        # A generator: the plan is taken at the first index drawn, i.e. after the DataLoader iterator was
        # built (which itself draws from the RNG), so the restored RNG state is the one at the save.
        plan, self._plan = self._plan, None
        if plan is None:
            yield from self.sampler
            return
        epoch, skip, on_start = plan
        if epoch is not None:
            self.set_epoch(epoch)
        if on_start is not None:
            on_start()
        yield from itertools.islice(iter(self.sampler), skip, None)


def make_resumable(dataloader: Any) -> tuple[Any, Decision]:
    """Re-instantiate a training ``DataLoader`` around a :class:`ResumableSampler` (as Lightning does to
    inject its ``DistributedSampler``); loaders it cannot handle are returned as they are."""
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    def refuse(why: str) -> tuple[Any, Decision]:
        return dataloader, Decision("resumable_data", False, why + "; a mid-epoch resume restarts the epoch")

    if not isinstance(dataloader, DataLoader):
        return refuse(f"the training loader is a {type(dataloader).__name__}, not a DataLoader")
    if isinstance(dataloader.sampler, ResumableSampler):
        return dataloader, Decision("resumable_data", True, "the training sampler is already resumable")
    if isinstance(dataloader.dataset, IterableDataset):
        return refuse("an IterableDataset has no sampler to fast-forward")
    if type(dataloader.batch_sampler) is not BatchSampler:
        return refuse(f"custom batch sampler {type(dataloader.batch_sampler).__name__}")
    inner = dataloader.sampler
    try:
        wrapped = _update_dataloader(dataloader, ResumableSampler(inner, dataloader.batch_size),
                                     mode=RunningStage.TRAINING)
    except Exception as err:  # noqa: BLE001 - any re-instantiation failure just means "not resumable"
        return refuse(f"the DataLoader could not be re-instantiated ({err})")
    if hasattr(inner, "set_epoch") or isinstance(inner, SequentialSampler):
        return wrapped, Decision("resumable_data", True,
                                 f"{type(inner).__name__} order is fixed by seed and epoch: skip the batches done")
    return wrapped, Decision(
        "resumable_data", "approximate",
        f"{type(inner).__name__} draws a new order from the global RNG each epoch, so a mid-epoch resume skips"
        " the right number of batches of a different order; Lightning's DistributedSampler (the default"
        " under DDP) is exact",
    )


# ---------------------------------------------------------------------------------------------------------
# RNG states, stored in a form that loads with torch.load(weights_only=True)


def rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, numpy and Python RNG states."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _python_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # Only this rank's device: another layout (8 GPUs per process before, 4 now, or per-task binding)
        # has other device indices, but each rank still draws from the generator of its own device.
        device = torch.cuda.current_device()
        state["cuda"] = {"device": device, "state": torch.cuda.get_rng_state(device)}
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"]["state"], torch.cuda.current_device())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"]))


def _python_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


# ---------------------------------------------------------------------------------------------------------
# save and restore the position


def capture(trainer: Any, sampler: ResumableSampler | None) -> dict[str, Any]:
    """The resume record; call on every rank (it gathers the RNG states of all ranks to each)."""
    dist = torch.distributed
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    local = rng_state()
    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    per_epoch = trainer.num_training_batches
    return {
        "epoch": sampler.epoch if sampler is not None else trainer.current_epoch,
        # batches of this epoch that were trained on (Lightning counts a batch "ready" when fetched for
        # training; a save in on_train_batch_end or on_validation_end has trained all of them)
        "consumed_batches": int(trainer.fit_loop.epoch_loop.batch_progress.current.ready),
        "batches_in_epoch": int(per_epoch) if per_epoch != float("inf") else -1,
        "batch_size": sampler.batch_size if sampler is not None else None,
        "world_size": world_size,
        "rng": gathered,
    }


def plan(record: dict[str, Any] | None, trainer: Any, sampler: ResumableSampler | None) -> Decision | None:
    """Arm ``sampler`` to continue where ``record`` left off (call once Lightning restored its loops)."""
    if record is None:
        return None
    dist = torch.distributed
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world_size > 1 else 0
    rng = record.get("rng") or []
    restore = (lambda: set_rng_state(rng[rank])) if len(rng) == world_size else None
    rng_note = "RNG states restored" if restore else f"RNG states not restored ({len(rng)} saved, {world_size} ranks)"
    if sampler is None:
        if restore is not None:
            restore()
        return Decision("mid_epoch_resume", False, "the training sampler is not resumable; " + rng_note)
    epoch, consumed, per_epoch = record["epoch"], record["consumed_batches"], record["batches_in_epoch"]
    mid_epoch = consumed > 0 and (per_epoch < 0 or consumed < per_epoch)
    loop_epoch = trainer.fit_loop.epoch_progress.current.processed
    if not mid_epoch or loop_epoch != epoch:
        # At a boundary the uninterrupted run built the next epoch's DataLoader iterator (one RNG draw for its
        # worker seed) after the save; here it is built right after this call, so restore now.
        if restore is not None:
            restore()
        return Decision("mid_epoch_resume", 0, f"the checkpoint is at an epoch boundary; {rng_note}")
    if record.get("world_size") != world_size or record.get("batch_size") != sampler.batch_size:
        sampler.resume_once(epoch, 0, restore)
        return Decision("mid_epoch_resume", 0,
                        f"saved with {record.get('world_size')} ranks x batch {record.get('batch_size')}, now"
                        f" {world_size} x {sampler.batch_size}: the shards differ, so epoch {epoch} restarts")
    sampler.resume_once(epoch, consumed * sampler.batch_size, restore)
    # Lightning's "your dataloader is not resumable" warning is about the loader it restarts; this one resumes.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    return Decision("mid_epoch_resume", consumed,
                    f"epoch {epoch} continues after the {consumed} batches already trained on; {rng_note}")
