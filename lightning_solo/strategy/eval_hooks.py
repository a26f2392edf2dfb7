"""SoloDDP's exact-evaluation hooks: every validate/test/predict sample counted once, every rank the same steps.

The sharding and the exact means are :mod:`lightning_solo.evaluation`; these hooks put them into Lightning's
loaders and its ``sync_dist`` reduction.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_solo.evaluation import mean_operand, shard_eval_loader
from lightning_solo.strategy.base import SoloStrategyBase


class ExactEvalHooks(SoloStrategyBase):
    """The evaluation hooks of :class:`~lightning_solo.strategy.SoloDDP` (not used on its own)."""

    _exact_eval: bool = True

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(
            dataloader
        )  # a training loader is made resumable (resume_hooks)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and not trainer.training and self._exact_eval:  # lightning_solo.evaluation
            dataloader, decision = shard_eval_loader(
                dataloader, self.world_size, self.global_rank, trainer.state.stage
            )
            self._decide(decision)
        return dataloader

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Lightning averages integer tensors (the batch sizes behind sync_dist epoch means) with truncation.
        return super().reduce(mean_operand(tensor, reduce_op), group, reduce_op)
