"""The training loader made resumable: a sampler that fast-forwards to a position, and samples loaded with RNGs
seeded from (seed, epoch, index) so augmentation and loader workers do not depend on which batches were skipped.

:func:`make_resumable` wraps the training loader SoloDDP is given; :mod:`lightning_solo.resume` saves the position
and restores it.

Example::

    sampler = ResumableSampler(DistributedSampler(dataset, num_replicas=2, rank=0), batch_size=32)
    sampler.resume_once(epoch=3, skip_samples=5 * 32)      # the next iteration starts at batch 5 of epoch 3
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, Sampler, SequentialSampler

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.decision import Decision


class ResumableSampler(Sampler):
    """Forwards to ``sampler`` (``tag_epoch``: as ``(epoch, index)`` pairs, for a :class:`SeededDataset`);
    after :meth:`resume_once` its next iteration sets that epoch, runs
    ``on_start`` (the RNG restore) and drops the first ``skip_samples`` indices. ``len`` is unchanged, so
    Lightning's batch counts (and its ``batch_idx``, which continues from the checkpoint) still hold."""

    def __init__(self, sampler: Sampler | Any, batch_size: int, tag_epoch: bool = False) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.tag_epoch = tag_epoch
        self.epoch = int(getattr(sampler, "epoch", 0))
        self._plan: tuple[int | None, int, Callable[[], None] | None] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def resume_once(
        self, epoch: int | None, skip_samples: int, on_start: Callable[[], None] | None = None
    ) -> None:
        """Arm the next iteration: ``epoch`` (``None``: keep what Lightning set), skip, RNG restore."""
        self._plan = (epoch, skip_samples, on_start)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        # A generator: the plan is taken at the first index drawn, i.e. after the DataLoader iterator was
        # built (which itself draws from the RNG), so the restored RNG state is the one at the save.
        plan, self._plan = self._plan, None
        if plan is None:
            yield from self._tag(iter(self.sampler))
            return
        epoch, skip, on_start = plan
        if epoch is not None:
            self.set_epoch(epoch)
        if on_start is not None:
            on_start()
        yield from self._tag(itertools.islice(iter(self.sampler), skip, None))

    def _tag(self, indices: Iterator[Any]) -> Iterator[Any]:
        # The epoch travels with each index to the (possibly persistent) worker that loads it.
        return ((self.epoch, i) for i in indices) if self.tag_epoch else indices


def _numpy_random() -> Any:
    import sys

    numpy = sys.modules.get("numpy")  # only if the program uses numpy: never import it for this
    return numpy.random if numpy is not None else None


class SeededDataset(Dataset):
    """Loads ``dataset[index]`` with the torch, Python and numpy RNGs seeded from ``(seed, epoch, index)``
    and puts the caller's RNG states back afterwards.

    A worker's RNG otherwise depends on the seed its iterator drew, on which worker got the sample and on
    everything that worker loaded before (across epochs with ``persistent_workers``), none of which a resume
    that skips batches can replay; in the main process (``num_workers=0``) the draws would shift the training
    RNG. Here a sample's augmentation is a function of the sample, so a resumed epoch loads exactly what the
    uninterrupted one would. Randomness in a ``collate_fn`` or ``worker_init_fn`` is not covered.
    """

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:  # the user's dataset attributes, as before the wrap
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, Any]]) -> list[Any]:
        # The DataLoader's fetcher asks for a whole batch here, so the caller's RNG states are saved and put back
        # once per batch: numpy's get/set alone cost ~110 µs, more than seeding a sample. Defining it also stops
        # ``__getattr__`` from handing the fetcher the user's own ``__getitems__`` (``Subset`` has one), which
        # would receive (epoch, index) keys.
        cpu, py, np_random = torch.default_generator.get_state(), random.getstate(), _numpy_random()
        np_state = np_random.get_state(legacy=False) if np_random is not None else None
        try:
            samples = []
            for epoch, index in keys:
                digest = hashlib.blake2b(f"{self.seed}:{epoch}:{index}".encode(), digest_size=8).digest()
                sample_seed = int.from_bytes(digest, "little") >> 1
                # The CPU generator only (torch.manual_seed would also seed every CUDA device: 0.3 ms a sample).
                torch.default_generator.manual_seed(sample_seed)
                random.seed(sample_seed)
                if np_random is not None:
                    np_random.seed(sample_seed % 2**32)
                samples.append(self.dataset[index])
            return samples
        finally:
            torch.default_generator.set_state(cpu)
            random.setstate(py)
            if np_random is not None:
                np_random.set_state(np_state)


def make_resumable(dataloader: Any, seed: int) -> tuple[Any, Decision]:
    """Re-instantiate a training ``DataLoader`` around a :class:`ResumableSampler` and a :class:`SeededDataset`
    (as Lightning does to inject its ``DistributedSampler``); loaders it cannot handle are returned as they are."""

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
    seeded = SeededDataset(dataloader.dataset, seed)

    def with_seeded_dataset(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "dataset" in kwargs:
            return args, {**kwargs, "dataset": seeded}
        if args and args[0] is dataloader.dataset:
            return (seeded, *args[1:]), kwargs
        raise TypeError("the DataLoader does not take its dataset as `dataset`")

    try:
        sampler = ResumableSampler(inner, dataloader.batch_size, tag_epoch=True)
        args, kwargs = with_seeded_dataset(*lightning_compat.dataloader_init_args(dataloader, sampler))
        wrapped = lightning_compat.reinstantiate(dataloader, args, kwargs)
    except Exception as err:  # noqa: BLE001 - any re-instantiation failure just means "not resumable"
        return refuse(f"the DataLoader could not be re-instantiated ({err})")
    if hasattr(inner, "set_epoch") or isinstance(inner, SequentialSampler):
        return wrapped, Decision(
            "resumable_data",
            True,
            f"{type(inner).__name__} order is fixed by seed and epoch: skip the batches done; each sample is loaded"
            " with the RNGs seeded from (seed, epoch, index), so augmentation and loader workers resume exactly",
        )
    return wrapped, Decision(
        "resumable_data",
        "approximate",
        f"{type(inner).__name__} draws a new order from the global RNG each epoch, so a mid-epoch resume skips"
        " the right number of batches of a different order; Lightning's DistributedSampler (the default"
        " under DDP) is exact",
    )
