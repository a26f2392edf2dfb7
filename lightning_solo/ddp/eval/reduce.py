"""Exact epoch means for ``self.log(..., sync_dist=True)``: Lightning's logged sample count averaged in floating
point (a user's own ``strategy.reduce`` of an integer tensor averages as stock does). See docs/evaluation.md."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ReduceOp

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.core.decision import Decision


def mean_operand(tensor: Any, reduce_op: Any, caller: Any = None) -> Any:
    """``tensor`` in float64 when it is an integer tensor about to be averaged and (given ``strategy.reduce``'s
    ``caller`` frame) a logged epoch mean's sample count; otherwise ``tensor`` itself."""
    averaging = reduce_op.lower() in ("mean", "avg") if isinstance(reduce_op, str) else reduce_op == ReduceOp.AVG
    if not (averaging and isinstance(tensor, torch.Tensor) and not tensor.is_floating_point()):
        return tensor
    if caller is not None and not lightning_compat.logged_sample_count(caller, tensor):
        return tensor  # a user's own integer tensor: as stock
    return tensor.to(torch.float64)


def decide_exact_eval(exact: bool) -> Decision:
    """``SoloDDP(exact_eval=...)``."""
    return Decision(
        "exact_eval",
        exact,
        "sync_dist epoch means average the sample counts in float (Lightning truncates them); eval loaders are "
        "Lightning's, their padding repeats named by eval_rows"
        if exact
        else "set by the user: Lightning's integer-truncated sync_dist means",
    )
