"""RunProgressBar: Lightning's tqdm bar that shows metrics it reads only when it refreshes. See docs/runner.md."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class RunProgressBar(TQDMProgressBar):
    """``train/loss`` shown too, read (a host sync on GPUs) only when the bar refreshes."""

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        logged = trainer.callback_metrics
        if "train/loss" in logged and "train/loss" not in items:
            items["train/loss"] = f"{float(logged['train/loss']):.3g}"
        return items
