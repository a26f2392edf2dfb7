"""OrderedPredictions: every eval step's per-sample predictions in one file in dataset order. See docs/evaluation.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

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

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        """Also the test and predict batches' hook."""
        if trainer.sanity_checking or _stage(trainer) not in self.stages:
            return
        predictions = outputs.get(self.key) if isinstance(outputs, Mapping) else outputs
        if not isinstance(predictions, torch.Tensor):
            return
        rows = eval_rows(trainer, batch_idx, dataloader_idx)
        if rows is None or len(rows.indices) != len(predictions):
            raise RuntimeError(
                "OrderedPredictions cannot tell which samples this batch holds: use SoloDDP (exact_eval=True) or "
                "a sequential loader on one process, and return one prediction per batch row"
            )
        keep = rows.valid
        self._rows.setdefault(dataloader_idx, []).append((rows.indices[keep], predictions.detach().cpu()[keep]))

    on_test_batch_end = on_predict_batch_end = on_validation_batch_end

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Also the test and predict epochs' hook: rank 0 gathers every rank's rows and writes them."""
        rows, self._rows, stage = self._rows, {}, _stage(trainer)
        if trainer.sanity_checking or stage not in self.stages:
            return
        loaders = len(getattr(trainer, f"num_{stage}_batches"))
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

    on_test_epoch_end = on_predict_epoch_end = on_validation_epoch_end
