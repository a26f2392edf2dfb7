"""RunProgressBar: Lightning's tqdm bar that shows metrics it reads only when it refreshes.
See docs/runner.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class RunProgressBar(TQDMProgressBar):
    """``show``: logged metrics the bar displays too, read (a host sync on GPUs) only when it refreshes."""

    def __init__(self, refresh_rate: int = 1, show: Sequence[str] = ("train/loss",), **kwargs: Any) -> None:
        super().__init__(refresh_rate=refresh_rate, **kwargs)
        self.show = tuple(show)

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        logged = trainer.callback_metrics
        for name in self.show:
            if name in logged and name not in items:
                items[name] = f"{float(logged[name]):.3g}"
        return items
