"""The training loader made resumable: a sampler that fast-forwards, and samples loaded with RNGs seeded from
(seed, epoch, index), whatever batches were skipped. See docs/checkpoints.md."""

from __future__ import annotations

import hashlib
import itertools
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.core.decision import Decision
from lightning_solo.core.rng import rng_state, set_rng_state

# torch's samplers that draw their whole order from the RNG when their iteration starts: a resume replays the draw.
_DRAWN = (RandomSampler, WeightedRandomSampler, SubsetRandomSampler)
_END = object()


def _user_sampler(sampler: Any) -> Any:
    """The sampler whose order it is: the user's, inside Lightning's ``DistributedSamplerWrapper``."""
    if isinstance(sampler, DistributedSamplerWrapper):
        return getattr(sampler.dataset, "_sampler", sampler)
    return sampler


class ResumableSampler(Sampler):
    """Forwards to ``sampler`` (``tag_epoch``: as :class:`SeededDataset.Key` pairs); after :meth:`resume_once` its next
    iteration sets that epoch and drops the first ``skip_samples`` indices (same ``len``). ``replay_rng``: each
    iteration records its starting RNG states in ``epoch_rng``; a resume draws the order again from them."""

    def __init__(
        self, sampler: Sampler | Any, batch_size: int, tag_epoch: bool = False, replay_rng: bool = False
    ) -> None:
        self.sampler: Any = sampler  # a Sampler, or any object with __iter__ and __len__
        self.batch_size = batch_size
        self.tag_epoch = tag_epoch
        self.replay_rng = replay_rng
        self.epoch = int(getattr(sampler, "epoch", 0))
        self.epoch_rng: dict[str, Any] | None = None
        self._plan: tuple[int | None, int | Callable[[], int], dict | None, Callable[[], None] | None] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        if self._plan is not None:  # Lightning set the epoch after the resume was armed: its epoch wins
            self._plan = (None, *self._plan[1:])

    def resume_once(
        self,
        epoch: int | None,
        skip_samples: int | Callable[[], int],
        epoch_rng: dict[str, Any] | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        """Arm the next iteration: ``epoch`` (``None``: Lightning's), the skip (or a callable), the order's RNG."""
        self._plan = (epoch, skip_samples, epoch_rng, on_start)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        # A generator: the plan is taken at the first index drawn, once Lightning built every loader and set the epoch.
        plan, self._plan = self._plan, None
        epoch, skip, epoch_rng, on_start = plan if plan is not None else (None, 0, None, None)
        if epoch is not None:
            self.set_epoch(epoch)
        if on_start is not None:
            on_start()
        skip = skip() if callable(skip) else skip
        generator = getattr(_user_sampler(self.sampler), "generator", None)
        replay = epoch_rng if self.replay_rng else None
        caller = None
        if replay is not None:
            caller = rng_state()
            set_rng_state(replay["rng"])
            if isinstance(generator, torch.Generator) and replay.get("generator") is not None:
                generator.set_state(replay["generator"])
        if self.replay_rng:
            own = generator.get_state() if isinstance(generator, torch.Generator) else None
            self.epoch_rng = {"rng": rng_state(), "generator": own}
        indices = iter(self.sampler)
        first = next(indices, _END)  # the order's draws happen here (RandomSampler draws at its first index)
        if caller is not None:
            set_rng_state(caller)
        if first is _END:
            return
        indices = itertools.islice(itertools.chain((first,), indices), skip, None)
        # The epoch travels with each index to the (possibly persistent) worker that loads it.
        yield from (SeededDataset.Key(self.epoch, i) for i in indices) if self.tag_epoch else indices


def _seed_of(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


class SeededDataset(Dataset):
    """The user's dataset, whose samples load with the torch, Python, numpy RNGs seeded from ``(seed, epoch, index)``.
    Its ``__class__`` property (not a patch) answers ``isinstance`` for the user's; ``type()`` and pickling do not."""

    class Key(NamedTuple):
        """An index from :class:`ResumableSampler`, with the epoch it was drawn in (no user index is one)."""

        epoch: int
        index: Any

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    @property  # type: ignore[misc]  # a read-only __class__ over the writable one: the point of the wrap
    def __class__(self) -> type:
        return type(self.dataset)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle (spawned workers) and copy: rebuilt from its parts; the default reduction would check __class__.
        return (SeededDataset, (self.dataset, self.seed))

    def __getattr__(self, name: str) -> Any:  # the user's dataset attributes, as before the wrap
        dataset = self.__dict__.get("dataset")  # (absent while unpickling)
        if dataset is None or name in ("dataset", "seed") or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        return getattr(dataset, name)

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)

    def __repr__(self) -> str:
        return repr(self.dataset)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, SeededDataset.Key):
            return self.__getitems__([key])[0]
        return self.dataset[key]

    def __getitems__(self, keys: list[Any]) -> Any:
        # The caller's RNG states saved and put back once per batch: numpy's get/set alone cost ~110 µs.
        batched = getattr(self.dataset, "__getitems__", None)
        if not keys or not isinstance(keys[0], SeededDataset.Key):  # the user's own indices: the user's fetch
            return batched(keys) if batched else [self.dataset[k] for k in keys]
        np_random = getattr(sys.modules.get("numpy"), "random", None)  # if the program uses numpy: never imported here
        cpu, py = torch.default_generator.get_state(), random.getstate()
        np_state = np_random.get_state(legacy=False) if np_random is not None else None
        try:
            if batched:
                indices = [key.index for key in keys]
                self._seed_all(_seed_of(f"{self.seed}:{keys[0].epoch}:{indices}"), np_random)
                return batched(indices)
            samples = []
            for epoch, index in keys:
                self._seed_all(_seed_of(f"{self.seed}:{epoch}:{index}"), np_random)
                samples.append(self.dataset[index])
            return samples
        finally:
            torch.default_generator.set_state(cpu)
            random.setstate(py)
            if np_random is not None:
                np_random.set_state(np_state)

    @staticmethod
    def _seed_all(seed: int, np_random: Any) -> None:
        # The CPU generator only (torch.manual_seed would also seed every CUDA device: 0.3 ms a sample).
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        if np_random is not None:
            np_random.seed(seed % 2**32)


# What every resumable loader trades, said in its Decision.
STREAMS = (
    "the training RNG streams differ from stock Lightning's (same distributions): each training sample loads with"
    " the torch/random/numpy RNGs seeded from (seed, epoch, index) (a dataset with __getitems__: once per batch,"
    " from (seed, epoch, the batch's indices)) and the caller's RNGs put back, and a validation inside fit leaves"
    " the training RNG as it found it;"
    " SoloDDP(exact_resume=False) keeps Lightning's loader and streams (a mid-epoch resume then restarts the"
    " epoch's data, as stock Lightning does)"
)


def _order(sampler: Any) -> tuple[bool | str, bool, str]:
    """(exact, replay the RNG at the epoch's start, why) for the sampler's order."""
    user = _user_sampler(sampler)
    name = type(user).__name__
    wrapped = " (in Lightning's DistributedSamplerWrapper)" if user is not sampler else ""
    if isinstance(user, SequentialSampler):
        return True, False, f"{name}{wrapped} order is fixed"
    if isinstance(user, DistributedSampler):
        return True, False, f"{name} order is fixed by seed and epoch"
    if type(user) in _DRAWN:
        why = (
            f"{name}{wrapped} draws its order from the RNG when the epoch starts; each checkpoint records that RNG"
            " state and a resume draws the order again from it"
        )
        return True, True, why
    why = (
        f"custom sampler {name}{wrapped}: the resume skips the right number of batches and replays the RNG state"
        " its epoch started from, exact only if its order is a function of that state and the epoch"
    )
    return "approximate", True, why


def make_resumable(dataloader: Any, seed: int) -> tuple[Any, Decision]:
    """``dataloader`` rebuilt around a :class:`ResumableSampler` and a :class:`SeededDataset`, or as is if it cannot."""

    def refuse(why: str) -> tuple[Any, Decision]:
        return dataloader, Decision(
            "resumable_data",
            False,
            f"{why}; a mid-epoch resume restarts its epoch. A validation inside fit still leaves the training RNG"
            " as it found it (SoloDDP(exact_resume=False): as stock)",
        )

    if not isinstance(dataloader, DataLoader):
        return refuse(f"the training loader is a {type(dataloader).__name__}, not a DataLoader")
    if isinstance(dataloader.sampler, ResumableSampler):
        return dataloader, Decision("resumable_data", True, "the training sampler is already resumable")
    if isinstance(dataloader.dataset, IterableDataset):
        return refuse("an IterableDataset has no sampler to fast-forward")
    if type(dataloader.batch_sampler) is not BatchSampler:
        return refuse(f"custom batch sampler {type(dataloader.batch_sampler).__name__}")
    inner = dataloader.sampler
    exact, replay, why = _order(inner)
    seeded = SeededDataset(dataloader.dataset, seed)

    def with_seeded_dataset(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "dataset" in kwargs:
            return args, {**kwargs, "dataset": seeded}
        if args and args[0] is dataloader.dataset:
            return (seeded, *args[1:]), kwargs
        raise TypeError("the DataLoader does not take its dataset as `dataset`")

    try:
        size = dataloader.batch_sampler.batch_size
        sampler = ResumableSampler(inner, size, tag_epoch=True, replay_rng=replay)
        args, kwargs = with_seeded_dataset(*lightning_compat.dataloader_init_args(dataloader, sampler))
        wrapped = lightning_compat.reinstantiate(dataloader, args, kwargs)
    except Exception as err:  # noqa: BLE001 - any re-instantiation failure just means "not resumable"
        return refuse(f"the DataLoader could not be re-instantiated ({err})")
    return wrapped, Decision("resumable_data", exact, f"{why}: the batches done are skipped; {STREAMS}")
