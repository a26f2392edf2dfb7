"""Uneven data cannot hang: when the ranks' loaders of an ``IterableDataset`` run out at different batches, every rank
ends its epoch (or evaluation) at the batch where the first rank runs out, agreed at each batch without a blocking
collective. See docs/ranks.md."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lightning_solo._compat.patch import Patches
from lightning_solo.core.decision import Decision
from lightning_solo.ddp.agreed_end import AgreedEnd

Policy = Literal["shortest"] | Literal[False]


def check_policy(policy: Any) -> Policy:
    """``uneven_data=``: "shortest" or False; "join" (torch's Join: the longer ranks finish) is not built."""
    if not (policy == "shortest" or policy is False):
        raise ValueError(
            f"uneven_data must be 'shortest' (every rank ends at the first rank's end) or False (stock), got {policy!r}"
        )
    return policy


class UnevenData:
    """The uneven-data policy of one strategy (``"shortest"`` or ``False``: stock): :meth:`setup` each run,
    :meth:`on_dataloader` for each loader."""

    def __init__(self, policy: Any = "shortest") -> None:
        self.policy = check_policy(policy)
        self._group: Any = None
        self._patches = Patches()
        self._wrapped: list[DataLoader] = []

    def setup(self, world_size: int, group: Any, patches: Patches) -> Decision:
        """This run's gloo group (``None``: none) and patches (undone at its end); returns what the policy does."""
        self._group = group if self.policy and world_size > 1 else None
        self._patches, self._wrapped = patches, []
        if not self.policy:
            return Decision("uneven_data", False, "uneven_data=False: as stock (uneven data hangs or fails)")
        if world_size == 1:
            return Decision("uneven_data", "shortest", "one rank: its data ends where it ends")
        if group is None:
            return Decision("uneven_data", False, "no gloo group for the per-batch agreement: as stock")
        return Decision(
            "uneven_data",
            "shortest",
            "an IterableDataset's loaders are read one batch ahead and the ranks agree asynchronously at each batch "
            "on the first end any rank knows: every rank ends the epoch (or evaluation) at the batch where the "
            "first rank runs out, the longer ranks' extra batches unread; where the ranks' loader lengths differ "
            "(map-style training data, an IterableDataset's __len__), each reports the shortest, agreed at setup; "
            "map-style evaluation loaders as they are "
            "(SoloDDP(uneven_data=False): as stock, which hangs or fails on uneven data)",
        )

    def on_dataloader(self, dataloader: Any, trainer: Any) -> Any:
        """``dataloader`` with its iterators read ahead and agreed (an ``IterableDataset``'s), and its length the
        shortest rank's where the ranks' lengths differ and Lightning would part them; any other as it is."""
        if self._group is None or not isinstance(dataloader, DataLoader):
            return dataloader
        training = trainer is not None and trainer.training
        iterable = isinstance(dataloader.dataset, IterableDataset)
        if (iterable or training) and len(set(limited := _limited(self._lengths(dataloader), trainer))) > 1:
            _agree_length(dataloader, int(min(limited)), self._patches)
        if iterable and not any(dataloader is wrapped for wrapped in self._wrapped):
            self._patches.set(dataloader, "_get_iterator", _AgreedIterators(dataloader._get_iterator, self._group))
            self._wrapped.append(dataloader)
        return dataloader

    def _lengths(self, dataloader: DataLoader) -> list[int]:
        """Every rank's ``len(dataloader)`` (-1: none), gathered on the group."""
        try:
            length = len(dataloader)
        except (TypeError, NotImplementedError):
            length = -1
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(gathered, torch.tensor([length]), group=self._group)
        return [int(t.item()) for t in gathered]


def _limited(lengths: list[int], trainer: Any) -> list[float]:
    """The batches Lightning runs of each rank's loader (-1: no length), under the stage's integer batch limit."""
    limit: Any = math.inf
    if trainer is not None:
        # TrainerFn is a str enum ("test", ...); a fit's loaders are training or validation (the sanity check's too).
        by_fn = {"test": trainer.limit_test_batches, "predict": trainer.limit_predict_batches}
        limit = (
            trainer.limit_train_batches if trainer.training else by_fn.get(trainer.state.fn, trainer.limit_val_batches)
        )
    limit = limit if isinstance(limit, int) else math.inf  # a fraction scales each rank's own length
    return [min(length if length >= 0 else math.inf, limit) for length in lengths]


def _agreed_len(dataloader: Any) -> int:
    """``__len__`` of a loader whose ranks agreed on a length (:func:`_agree_length`)."""
    return dataloader._solo_agreed_len


_AGREED_CLASSES: dict[type, type] = {}  # a loader's own class -> its subclass with the agreed ``__len__``


def _agree_length(dataloader: DataLoader, length: int, patches: Patches) -> None:
    """``len(dataloader)`` is ``length`` until ``patches`` close. The loader stays the user's object, of a subclass of
    its own class named as it: ``trainer.train_dataloader.dataset``, ``isinstance`` and its iterators are as they
    were (``DataLoader`` refuses a new sampler once built, and rebuilding it would call a subclass's ``__init__``)."""
    agreed_now = type(dataloader) in _AGREED_CLASSES.values()
    own: type = type(dataloader).__mro__[1] if agreed_now else type(dataloader)
    if (agreed := _AGREED_CLASSES.get(own)) is None:
        names = {"__len__": _agreed_len, "__qualname__": own.__qualname__, "__module__": own.__module__}
        agreed = _AGREED_CLASSES[own] = type(own.__name__, (own,), {**names, "__doc__": own.__doc__})
    patches.set(dataloader, "_solo_agreed_len", length)
    patches.set(dataloader, "__class__", agreed)


class _AgreedIterators:
    """A ``DataLoader._get_iterator`` whose iterators are :class:`AgreedEnd` around the loader's own."""

    def __init__(self, get_iterator: Any, group: Any) -> None:
        self.get_iterator = get_iterator
        self.group = group

    def __call__(self) -> AgreedEnd:
        return AgreedEnd(self.get_iterator(), self.group)
