"""Every rank's iterator ends at the same item, the first rank's end, agreed at each item without a blocking
collective: the mechanism of :mod:`lightning_solo.ddp.uneven` (docs/ranks.md)."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from lightning_solo.ddp.agreement import Agreement

# Items read beyond the one handed out: a rank knows its end one item before, in time for the others to read it.
AHEAD = 1


class AgreedEnd(Iterator):
    """This rank's ``iterator`` (a ``DataLoader``'s), ending where the first rank's ends, agreed on the gloo
    ``group``; every rank calls ``next`` at the same points, as Lightning's loops do."""

    def __init__(self, iterator: Any, group: Any) -> None:
        self.iterator = iterator
        self.group = group
        self._start()

    def _start(self) -> None:
        self._agreement = Agreement(self.group, op=dist.ReduceOp.MIN)
        self._ahead: collections.deque[Any] = collections.deque()
        self._exhausted = False  # this rank's iterator ran out
        self._given = 0
        self._end: float = math.inf  # the agreed end: the items every rank hands out
        self._ended = False

    def __next__(self) -> Any:
        if self._ended:
            raise StopIteration
        while not self._exhausted and len(self._ahead) <= AHEAD:
            try:
                self._ahead.append(next(self.iterator))
            except StopIteration:
                self._exhausted = True
        known = self._given + len(self._ahead) if self._exhausted else math.inf
        agreed = self._agreement.exchange(known)
        if self._given == 0 and self._agreement.in_flight:
            agreed = self._agreement.settle_value()  # no item before this one agreed: wait for this one's
        if agreed is not None:
            self._end = min(self._end, agreed)
        if self._given >= self._end:
            self._agreement.settle_value()  # this item's, which every rank started here
            self._ended = True
            raise StopIteration
        self._given += 1
        return self._ahead.popleft()

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        # DataLoader(persistent_workers=True) keeps its iterator and resets it for the next epoch.
        self.iterator._reset(loader, first_iter)
        self._start()

    def __len__(self) -> int:
        return len(self.iterator)

    def __getattr__(self, name: str) -> Any:  # the loader iterator's own attributes (workers, ...)
        if name == "iterator":
            raise AttributeError(name)
        return getattr(self.iterator, name)
