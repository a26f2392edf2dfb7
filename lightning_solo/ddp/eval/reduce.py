"""Exact epoch means for ``self.log(..., sync_dist=True)``: averages of integer tensors taken in floating point.

Lightning's epoch mean of a logged value is ``mean_ranks(Σ value·batch_size) / mean_ranks(Σ batch_size)``, with
the batch sizes summed in an integer tensor. Its cross-rank mean divides that integer tensor by the world size
in place (gloo; NCCL's integer average truncates too), so 101 samples on 2 ranks count as 50: the logged mean is
off by 1%. :class:`~lightning_solo.SoloDDP` passes that sample count, and only it, through :func:`mean_operand`:
a user's own ``strategy.reduce`` of an integer tensor averages as stock does.

Example::

    mean_operand(torch.tensor(101), "mean")    # tensor(101., dtype=torch.float64): averages to 50.5, not 50
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ReduceOp

from lightning_solo._compat import lightning as lightning_compat


def mean_operand(tensor: Any, reduce_op: Any, caller: Any = None) -> Any:
    """``tensor`` in float64 when it is an integer tensor about to be averaged and, given the ``caller`` frame of
    ``strategy.reduce``, the sample count of a logged epoch mean; otherwise ``tensor`` itself."""
    if caller is not None and not lightning_compat.logged_sample_count(caller, tensor):
        return tensor
    averaging = (
        reduce_op.lower() in ("mean", "avg") if isinstance(reduce_op, str) else reduce_op == ReduceOp.AVG
    )
    if averaging and isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
        return tensor.to(torch.float64)
    return tensor
