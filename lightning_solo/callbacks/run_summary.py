"""RunSummary: time the training, then print and save the run summary on rank 0.

Example::

    trainer = L.Trainer(strategy=SoloDDP(), callbacks=[RunSummary()])
    trainer.fit(model, dm)          # prints the table; writes <default_root_dir>/summary.json
    trainer.callbacks[-1].summary   # the same as a dict (on rank 0)
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_solo.summary import build_summary, format_summary, save_summary


class RunSummary(L.Callback):
    """Measures training throughput (validation excluded) and the learning rate range."""

    def __init__(self, filename: str = "summary.json") -> None:
        self.filename = filename
        self.summary: dict[str, Any] | None = None
        self._train_seconds = 0.0
        self._samples = 0
        self._batch_started: float | None = None
        self._lr: dict[str, float] = {}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train_seconds, self._samples = 0.0, 0
        self._fit_started = time.perf_counter()
        self._lr = {}
        self._note_lr(trainer, "lr_start")

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._batch_started = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._batch_started is not None:
            self._train_seconds += time.perf_counter() - self._batch_started
        inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
        self._samples += len(inputs) * trainer.world_size
        self._note_lr(trainer, "lr_peak", peak=True)

    def _note_lr(self, trainer: L.Trainer, key: str, peak: bool = False) -> None:
        if not trainer.optimizers:
            return
        lr = float(trainer.optimizers[0].param_groups[0]["lr"])
        self._lr[key] = max(lr, self._lr.get(key, lr)) if peak else lr

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._note_lr(trainer, "lr_final")
        timing = {
            "train_seconds": self._train_seconds,
            "wall_seconds": time.perf_counter() - self._fit_started,
            "samples_seen": self._samples,
            "samples_per_second": self._samples / self._train_seconds if self._train_seconds else 0.0,
        }
        summary = build_summary(trainer, timing, dict(self._lr))
        if trainer.is_global_zero:
            self.summary = summary
            save_summary(summary, f"{trainer.default_root_dir}/{self.filename}")
            rank_zero_info(format_summary(summary))
