"""The trial behind the "auto" settings that measure (``comm_hook="auto"``, ``compile="auto"``): optimizer steps
timed per arm, and one collective that gives every rank the same times, hence the same choice."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist


class Trial:
    """Times the optimizer steps of ``schedule``, one arm each (``None``: a warm-up step, timed but not reported),
    from the batch start that opens a step to the step's end. Call :meth:`batch_start` and :meth:`step_end` on
    every rank alike; once :attr:`done`, :meth:`agree` (a collective) gives each arm's times."""

    def __init__(self, schedule: Sequence[str | None]) -> None:
        self.schedule = list(schedule)
        self.times: list[float] = []  # this rank's seconds per step done
        self.stepped = False  # the last batch ended an optimizer step
        self._started: float | None = None

    @property
    def arm(self) -> str | None:
        """The arm of the step running now."""
        return self.schedule[len(self.times)]

    @property
    def done(self) -> bool:
        return len(self.times) == len(self.schedule)

    def batch_start(self, device: torch.device) -> bool:
        """At every batch start. True: a new optimizer step starts here (the previous batch ended one)."""
        new, self.stepped = self.stepped, False
        if self._started is None:
            self._started = _now(device)
        return new

    def step_end(self, device: torch.device) -> None:
        """At the end of every optimizer step."""
        if self._started is not None:
            self.times.append(_now(device) - self._started)
            self._started, self.stepped = None, True

    def agree(self, device: torch.device) -> dict[str, list[float]]:
        """Each arm's step times in seconds, the slowest rank's per step: one MAX all-reduce over the ranks."""
        times = torch.tensor(self.times, dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
        per_arm: dict[str, list[float]] = {}
        for arm, seconds in zip(self.schedule, times.tolist()):
            if arm is not None:
                per_arm.setdefault(arm, []).append(seconds)
        return per_arm


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # during a trial only
    return time.perf_counter()
