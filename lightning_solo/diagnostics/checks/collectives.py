"""The diagnostics' collectives on the default group; without a process group, this rank's value alone."""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

from lightning_solo.core.ranks import world_size

T = TypeVar("T")


def gather_objects(mine: T) -> list[T]:
    """Every rank's picklable ``mine``, index = rank (``all_gather_object``)."""
    if world_size() == 1:
        return [mine]
    every: list = [None] * world_size()
    dist.all_gather_object(every, mine)
    return every


def gather_rows(mine: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D ``mine`` (same length and device on every rank) stacked, row = rank; no autograd."""
    mine = mine.reshape(-1)
    if world_size() == 1:
        return mine[None]
    out = torch.empty(world_size() * mine.numel(), dtype=mine.dtype, device=mine.device)
    # torch 2.14 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, mine)  # out flat: gloo's need
    return out.reshape(world_size(), -1)
