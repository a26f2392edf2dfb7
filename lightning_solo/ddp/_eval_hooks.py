"""SoloDDP's evaluation hook: exact ``sync_dist`` epoch means.

The loaders stay as Lightning makes them (``DistributedSampler``: every rank the same batches, up to ``W - 1``
padding repeats, which :func:`lightning_solo.ddp.eval.eval_rows` names); see :mod:`lightning_solo.ddp.eval`.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_solo.ddp._base import SoloStrategyBase
from lightning_solo.ddp.eval import mean_operand


class ExactEvalHooks(SoloStrategyBase):
    """The evaluation hook of :class:`~lightning_solo.ddp.strategy.SoloDDP` (not used on its own)."""

    _exact_eval: bool = True

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Lightning averages integer tensors (the batch sizes behind sync_dist epoch means) with truncation.
        if self._exact_eval:
            tensor = mean_operand(tensor, reduce_op)
        return super().reduce(tensor, group, reduce_op)
