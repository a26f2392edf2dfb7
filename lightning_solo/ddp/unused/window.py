"""``find_unused_parameters="auto"``'s evidence: the usage map DDP all-reduces every step on ``True``."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_solo._compat import torch as torch_compat


class UsageWindow:
    """Synchronised steps of evidence about the parameters (``steps`` of them), indexed in the policy's order."""

    def __init__(self) -> None:
        self.steps = 0
        self._never: torch.Tensor | None = None  # unused on every rank at every step so far
        self._varying: torch.Tensor | None = None  # unused on some rank at some step

    def add(self, ddp: DistributedDataParallel, to_ours: list[int], params: int) -> None:
        """Read this step's usage map; ``to_ours[reducer_index]``: the policy's index (of ``params``), -1: none."""
        self.steps += 1
        counts = torch_compat.local_used_map(ddp).cpu()  # how many ranks used each parameter, reducer order
        world = ddp.process_group.size()
        never = torch.zeros(params, dtype=torch.bool)
        varying = torch.zeros(params, dtype=torch.bool)
        for reducer_index, ours in enumerate(to_ours):
            if ours < 0:
                continue
            never[ours] = counts[reducer_index] == 0
            varying[ours] = counts[reducer_index] < world
        self._never = never if self._never is None else self._never & never
        self._varying = varying if self._varying is None else self._varying | varying

    def never(self) -> list[int]:
        """Indices that no rank used at any step of the window."""
        return [] if self._never is None else self._never.nonzero().flatten().tolist()

    def varying(self) -> list[int]:
        """Indices used on some steps or ranks only."""
        if self._never is None or self._varying is None:
            return []
        return (self._varying & ~self._never).nonzero().flatten().tolist()
