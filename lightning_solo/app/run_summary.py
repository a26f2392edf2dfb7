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

from lightning_solo.app.summary import build_summary, format_summary, save_summary


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
        self._train_started = time.perf_counter()
        self._lr = {}

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._batch_started = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._batch_started is not None:
            self._train_seconds += time.perf_counter() - self._batch_started
        inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
        self._samples += len(inputs) * trainer.world_size

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Read here, not at batch end: this is the lr the step uses (a scheduler callback may change it after).
        lr = float(optimizer.param_groups[0]["lr"])
        self._lr.setdefault("first_step", lr)
        self._lr["peak"] = max(lr, self._lr.get("peak", lr))
        self._lr["last_step"] = lr

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # on_fit_end, not on_train_end: the strategy's end-of-training advice and decisions exist by now.
        timing = {
            "train_seconds": self._train_seconds,
            "wall_seconds": time.perf_counter() - getattr(self, "_train_started", time.perf_counter()),
            "samples_seen": self._samples,
            "samples_per_second": self._samples / self._train_seconds if self._train_seconds else 0.0,
        }
        summary = build_summary(trainer, timing, dict(self._lr))
        if trainer.is_global_zero:
            self.summary = summary
            save_summary(summary, f"{trainer.default_root_dir}/{self.filename}")
            rank_zero_info(format_summary(summary))

    @override
    def state_dict(self) -> dict[str, Any]:
        # Empty until the fit has ended (checkpoints taken during it hold nothing); a forked fit's summary comes
        # back to the notebook through it.
        return {"summary": self.summary} if self.summary is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.summary = state_dict.get("summary", self.summary)
