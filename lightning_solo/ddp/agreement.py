"""Any rank flagged, all stop: an asynchronous all-reduce on a gloo group, read one check later, behind the SIGTERM
agreement, SLURM's requeue and the end of uneven data (MIN of a number). See docs/sigterm.md."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Agreement:
    """Whether any rank raised its flag, agreed one check later, on ``group`` (``None``: one rank, whose own flag is
    the answer); ``op``: MAX for a flag, MIN for :meth:`exchange` of a number every rank bounds."""

    def __init__(self, group: Any, op: Any = dist.ReduceOp.MAX) -> None:
        self.group = group
        self.op = op
        self._pending: tuple[torch.Tensor, Any] | None = None

    @property
    def in_flight(self) -> bool:
        """A check's all-reduce was started and not yet read."""
        return self._pending is not None

    def check(self, flagged: bool) -> bool:
        """Start this check's all-reduce of ``flagged`` and read the one started at the previous check: True when
        some rank was flagged then. Call on every rank at the same points; with no group: ``flagged``."""
        agreed = self.exchange(float(flagged))
        return agreed is not None and agreed > 0

    def exchange(self, value: float) -> float | None:
        """Start this check's all-reduce of ``value`` and return the one started at the previous check (``None``:
        there was none). With no group: ``value``."""
        if self.group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)  # exact for any batch count
        previous = self._pending
        self._pending = (tensor, dist.all_reduce(tensor, op=self.op, group=self.group, async_op=True))
        return _read(previous) if previous is not None else None

    def settle(self) -> bool:
        """Wait for the check in flight, if any, and whether it found a rank flagged; only where every rank gets
        here (every rank started it)."""
        agreed = self.settle_value()
        return agreed is not None and agreed > 0

    def settle_value(self) -> float | None:
        """Wait for the check in flight and return its reduced value (``None``: none in flight); as :meth:`settle`."""
        pending, self._pending = self._pending, None
        return _read(pending) if pending is not None else None


def _read(pending: tuple[torch.Tensor, Any]) -> float:
    agreed, work = pending
    work.wait()
    return float(agreed.item())
