"""Uneven data cannot hang: when the ranks' loaders of an ``IterableDataset`` run out at different batches, every rank
ends its epoch (or evaluation) at the batch where the first rank runs out, agreed at each batch without a blocking
collective.

Stock DDP on uneven data: the rank whose loader ends first leaves the epoch; from then on the ranks' collectives
(DDP's gradient all-reduce, ``sync_dist`` logging, an in-fit validation) no longer belong to the same step, and the
run trains on misaligned steps until a collective has no partner: "Connection closed by peer" on gloo, the timeout
on NCCL. An ``IterableDataset`` has no sampler to even the ranks out (``DistributedSampler`` does for map-style data),
and its ``__len__``, where it has one, is the user's word.

:class:`UnevenData` wraps each such loader's iterators (training, validation, test, predict) in
:class:`~lightning_solo.ddp.agreed_end.AgreedEnd`: read one batch ahead, so that a rank knows one batch before that
its next batch is its last, and at each batch an asynchronous MIN all-reduce of "the end I know", read at the next
one; every rank ends at the first rank's end (the first batch of an iteration waits for its own all-reduce: one
wait an epoch). Lightning's fetcher, which reads one batch ahead of training, sees every rank's loader end after
the same batch, so ``is_last_batch`` (and with it the epoch-end validation, the epoch's schedulers and
checkpoints) is the same on every rank.

The longer ranks' extra batches are not read that epoch. A ``__len__`` that overstates ends as the data does, on
every rank together (with no epoch-end validation, as on one process: Lightning waits for the promised batch). Map-style loaders are left alone: their sampler's length is what they give, and
``DistributedSampler`` gives every rank the same. Where the ranks' lengths differ and Lightning, which schedules
each rank by its own length, would part them (a training loader of map-style data, an ``IterableDataset`` whose
``__len__`` differs), the loader's setup raises a ``ValueError`` that says so, instead of the hang. A loader that is
not a torch ``DataLoader`` is left alone. ``SoloDDP(uneven_data=False)``: as stock.

Example::

    uneven = UnevenData("shortest")
    decision = uneven.setup(world_size=2, group=gloo_group)     # each run, on every rank
    loader = uneven.on_dataloader(loader, trainer)              # every loader the strategy processes
    uneven.uninstall()                                          # at teardown
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lightning_solo.core.decision import Decision
from lightning_solo.ddp.agreed_end import AgreedEnd

Policy = Literal["shortest"] | Literal[False]


def check_policy(policy: Any) -> Policy:
    """``uneven_data=``: "shortest" or False; "join" (torch's Join: the longer ranks finish) is not built."""
    if not (policy == "shortest" or policy is False):
        raise ValueError(
            f"uneven_data must be 'shortest' (every rank ends at the first rank's end) or False (stock), "
            f"got {policy!r}"
        )
    return policy


class UnevenData:
    """The uneven-data policy of one strategy: :meth:`setup` each run, :meth:`on_dataloader` for each loader,
    :meth:`uninstall` at teardown.

    Args:
        policy: ``"shortest"``: every rank ends at the first rank's end; ``False``: stock Lightning.
    """

    def __init__(self, policy: Any = "shortest") -> None:
        self.policy = check_policy(policy)
        self._group: Any = None
        self._wrapped: list[DataLoader] = []

    def setup(self, world_size: int, group: Any) -> Decision:
        """This run's group (the gloo side group; ``None`` where there is none) and what the policy does."""
        self._group = group if self.policy and world_size > 1 else None
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
            "first rank runs out, the longer ranks' extra batches unread; map-style loaders as they are "
            "(SoloDDP(uneven_data=False): as stock, which hangs or fails on uneven data)",
        )

    def on_dataloader(self, dataloader: Any, trainer: Any) -> Any:
        """``dataloader`` with its iterators read ahead and agreed (an ``IterableDataset``'s ``DataLoader``, while
        the policy runs); any other as it is. Through its ``_get_iterator``, which :meth:`uninstall` gives back.

        Raises ``ValueError`` where the ranks' lengths differ and Lightning would part them: an ``IterableDataset``
        whose ``__len__`` differs (Lightning schedules the epoch's end, its validation and an evaluation's limit by
        each rank's own length), or a training loader of map-style data (every step has a collective). One
        all-gather of the lengths per sized loader, where Lightning reduces them too; an uneven map-style
        evaluation loader is left as it is (stock runs it where the evaluation has no per-batch collective). A
        batch limit (``limit_train_batches=7``, ...) at or below every rank's length keeps the ranks together."""
        if self._group is None or not isinstance(dataloader, DataLoader):
            return dataloader
        training = trainer is not None and trainer.training
        iterable = isinstance(dataloader.dataset, IterableDataset)
        if (iterable or training) and len(set(_limited(lengths := self._lengths(dataloader), trainer))) > 1:
            fix = (
                "give every rank the same __len__, or none (SoloDDP then ends every rank at the first rank's end)"
                if iterable
                else "give every rank the same number of batches (DistributedSampler, drop_last=True)"
            )
            raise ValueError(
                f"uneven data: the ranks' {'training' if training else 'evaluation'} loaders have {lengths} "
                f"batches, and Lightning schedules each rank by its own length, so the ranks would part and hang: "
                f"{fix}; SoloDDP(uneven_data=False): as stock"
            )
        if iterable and not any(dataloader is wrapped for wrapped in self._wrapped):
            agreed = _AgreedIterators(dataloader._get_iterator, self._group)
            dataloader._get_iterator = agreed  # type: ignore[method-assign,assignment]  # undone by uninstall()
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

    def uninstall(self) -> None:
        """Give the loaders their own iterators back (a later run decides again)."""
        for dataloader in self._wrapped:
            vars(dataloader).pop("_get_iterator", None)
        self._wrapped = []


def _limited(lengths: list[int], trainer: Any) -> list[float]:
    """The batches Lightning runs of each rank's loader (-1: no length), under the stage's integer batch limit."""
    limit: Any = math.inf
    if trainer is not None:
        # TrainerFn is a str enum ("test", ...); a fit's loaders are training or validation (the sanity check's too).
        by_fn = {"test": trainer.limit_test_batches, "predict": trainer.limit_predict_batches}
        limit = (
            trainer.limit_train_batches
            if trainer.training
            else by_fn.get(trainer.state.fn, trainer.limit_val_batches)
        )
    limit = limit if isinstance(limit, int) else math.inf  # a fraction scales each rank's own length
    return [min(length if length >= 0 else math.inf, limit) for length in lengths]


class _AgreedIterators:
    """A ``DataLoader._get_iterator`` whose iterators are :class:`AgreedEnd` around the loader's own."""

    def __init__(self, get_iterator: Any, group: Any) -> None:
        self.get_iterator = get_iterator
        self.group = group

    def __call__(self) -> AgreedEnd:
        return AgreedEnd(self.get_iterator(), self.group)
