"""The trial behind the "auto" settings that measure (``comm_hook="auto"``, ``compile="auto"``): optimizer steps
timed per arm, and one collective that gives every rank the same times, hence the same choice."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist


class Trial:
    """Times the optimizer steps of ``schedule``, one arm each (``None``: warm-up, not reported), from the batch
    start that opens a step to its end, on every rank alike; ``times``/``stepped``: a trial resumed."""

    def __init__(self, schedule: Sequence[str | None], times: Sequence[float] = (), stepped: bool = False) -> None:
        self.schedule, self.times = list(schedule), list(times)  # this rank's seconds per step done
        self.stepped = stepped  # the last batch ended an optimizer step
        self._started: float | None = None
        self.done = len(self.times) == len(self.schedule)
        self.arm = None if self.done else self.schedule[len(self.times)]  # the step running now

    def batch_start(self, device: torch.device) -> bool:
        """At every batch start. True: a new optimizer step starts here (the previous batch ended one)."""
        new, self.stepped = self.stepped, False
        if self._started is None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self._started = time.perf_counter()
        return new

    def step_end(self, device: torch.device) -> None:
        if self._started is not None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.times.append(time.perf_counter() - self._started)
            self._started, self.stepped = None, True
            self.done = len(self.times) == len(self.schedule)  # attributes, not properties: no call per step
            self.arm = None if self.done else self.schedule[len(self.times)]

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
