"""What SoloDDP's hook classes share: typed access to what Lightning has set before any of their hooks runs."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_solo.core.decision import DecisionLog
from lightning_solo.ddp import comm
from lightning_solo.ddp.unused.policy import UnusedParameters


class SoloStrategyBase(DecisionLog, DDPStrategy):
    """The base of :class:`~lightning_solo.ddp.strategy.SoloDDP` and its hook classes (not used on its own)."""

    _comm: comm.CommHook
    _unused: UnusedParameters
    _barrier_group: Any

    @property
    def module(self) -> pl.LightningModule:
        """The LightningModule (Lightning connects it before setup; every hook here runs after)."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError(
                "SoloDDP has no LightningModule yet: it is connected by Trainer.fit/validate/test"
            )
        return module

    @property
    def wrapped(self) -> torch.nn.Module:
        """The model as training runs it: the DDP wrapper once set up."""
        if self.model is None:
            raise RuntimeError("SoloDDP has no model yet: it is connected by Trainer.fit/validate/test")
        return self.model

    @property
    def collective_timeout(self) -> timedelta:
        return self._timeout if self._timeout is not None else timedelta(minutes=30)
