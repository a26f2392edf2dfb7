"""Where this process stands in the default process group: the world size and rank, 1 and 0 outside one."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def world_size(group: Any = None) -> int:
    """The size of ``group`` (default: the world), or 1 when no process group is initialised (one process)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group, or 0 when no process group is initialised."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
