"""OrderedPredictions: what each validate/test/predict step predicts, per sample, in one file in dataset order.
See docs/evaluation.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_solo.ddp.eval import eval_rows, gather_rows, write_predictions

STAGES = ("val", "test", "predict")


def _stage(trainer: L.Trainer) -> str:
    return (trainer.state.stage.dataloader_prefix or "") if trainer.state.stage is not None else ""


class OrderedPredictions(Callback):
    """Gather per-sample predictions to rank 0 in dataset order and write them (arguments: docs/evaluation.md)."""

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "predictions_{stage}.csv",
        key: str = "preds",
        stages: Sequence[str] = STAGES,
    ) -> None:
        unknown = [s for s in stages if s not in STAGES]
        if unknown or "{stage}" not in filename:
            raise ValueError(
                f"stages must be among {STAGES} (got {list(stages)}) and filename must contain '{{stage}}'"
                f" (got {filename!r})"
            )
        self.dirpath, self.filename, self.key, self.stages = dirpath, filename, key, tuple(stages)
        self.written: dict[str, Path] = {}
        self.counts: dict[str, int] = {}
        self._rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _predictions(self, outputs: Any) -> torch.Tensor | None:
        if isinstance(outputs, Mapping):
            outputs = outputs.get(self.key)
        return outputs if isinstance(outputs, torch.Tensor) else None

    def _collect(self, trainer: L.Trainer, outputs: Any, batch_idx: int, dataloader_idx: int) -> None:
        if trainer.sanity_checking or _stage(trainer) not in self.stages:
            return
        predictions = self._predictions(outputs)
        if predictions is None:
            return
        rows = eval_rows(trainer, batch_idx, dataloader_idx)
        if rows is None or len(rows.indices) != len(predictions):
            raise RuntimeError(
                "OrderedPredictions cannot tell which samples this batch holds: use SoloDDP (exact_eval=True) or "
                "a sequential loader on one process, and return one prediction per batch row"
            )
        keep = rows.valid
        self._rows.setdefault(dataloader_idx, []).append((rows.indices[keep], predictions.detach().cpu()[keep]))

    def _write(self, trainer: L.Trainer, stage: str, loaders: int) -> None:
        rows, self._rows = self._rows, {}
        if trainer.sanity_checking or stage not in self.stages:
            return
        for dataloader_idx in range(loaders):  # every rank gathers for every loader, in the same order
            parts = rows.get(dataloader_idx, [])
            indices = torch.cat([p[0] for p in parts]) if parts else torch.empty(0, dtype=torch.long)
            values = torch.cat([p[1] for p in parts]) if parts else torch.empty(0)
            gathered = gather_rows(indices, values)
            if gathered is None or not len(gathered[0]):
                continue
            name = stage + (f"_{dataloader_idx}" if dataloader_idx else "")
            directory = Path(self.dirpath or trainer.default_root_dir)
            self.written[name] = write_predictions(directory / self.filename.format(stage=name), *gathered)
            self.counts[name] = len(gathered[0])
            rank_zero_info(f"[OrderedPredictions] {self.counts[name]} {name} predictions → {self.written[name]}")

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(trainer, outputs, batch_idx, dataloader_idx)

    @override
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(trainer, outputs, batch_idx, dataloader_idx)

    @override
    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(trainer, outputs, batch_idx, dataloader_idx)

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "val", len(trainer.num_val_batches))

    @override
    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "test", len(trainer.num_test_batches))

    @override
    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "predict", len(trainer.num_predict_batches))
