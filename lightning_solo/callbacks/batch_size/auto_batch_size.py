"""AutoBatchSize: the per-device batch whose peak memory is a target fraction of the device. See docs/diagnostics.md."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_solo.callbacks.batch_size.probe import MemoryProbe
from lightning_solo.callbacks.batch_size.search import check_band, decide_batch_size, search_batch_size
from lightning_solo.core.batch_size import per_device_batch_size, set_per_device_batch_size
from lightning_solo.core.checks import check_int, check_number
from lightning_solo.core.decision import Decision, DecisionLog


class AutoBatchSize(DecisionLog, Callback):
    """The per-device batch whose peak memory is ``fraction ± tolerance`` of the budget (docs/diagnostics.md)."""

    def __init__(
        self,
        fraction: float = 0.7,
        tolerance: float = 0.1,
        cap_mb: float | None = None,
        max_batch_size: int | None = None,
        max_probes: int = 8,
    ) -> None:
        self.low, self.high = check_band(fraction, tolerance)
        self.fraction, self.tolerance = fraction, tolerance
        self.cap_mb = check_number("cap_mb", cap_mb, optional=True)
        self.max_batch_size = check_int("max_batch_size", max_batch_size, optional=True)
        self.max_probes = check_int("max_probes", max_probes)
        self.decisions: dict[str, Decision] = {}
        self.batch_size: int | None = None
        self.measured: list[float] = []  # every rank's fraction for the chosen batch
        self.measured_reserved: list[float] = []  # the same for the allocator's reserved peak (GPU; nan on CPU)
        self._trainer: L.Trainer | None = None

    def _decide(self, decision: Decision) -> Decision:
        rank_zero_info(f"[AutoBatchSize] {decision}")
        return super()._decide(decision)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        source = getattr(trainer, "datamodule", None) or pl_module  # set by Lightning when given one
        loader = source.train_dataloader()
        dataset, collate = loader.dataset, loader.collate_fn
        max_batch = self.max_batch_size or max(1, len(dataset) // trainer.world_size)
        cap = None if self.cap_mb is None else int(self.cap_mb * 2**20)
        probe = MemoryProbe(trainer.strategy.root_device, cap, local_processes=trainer.num_devices)
        pl_module.to(trainer.strategy.root_device)
        rows_at: dict[int, list[list[float]]] = {}  # per batch, every rank's (allocated, reserved, failed)

        def measure(batch_size: int) -> float:  # the same batch on every rank; the worst rank decides
            batch = collate([dataset[i % len(dataset)] for i in range(batch_size)])
            batch = trainer.strategy.batch_to_device(batch)
            failure: BaseException | None = None
            try:
                local = [probe.measure(pl_module, trainer.precision_plugin, batch), probe.reserved, 0.0]
            except Exception as err:  # noqa: BLE001 - every rank must learn it before anyone raises
                failure, local = err, [math.nan, math.nan, 1.0]
            gathered = trainer.strategy.all_gather(torch.tensor(local, device=trainer.strategy.root_device))
            rows = gathered.reshape(-1, 3).tolist()
            failed = [rank for rank, row in enumerate(rows) if row[2]]
            if failed:  # every rank raises here, at the same probe: no rank waits for another's next collective
                message = f"AutoBatchSize: the probe at batch {batch_size} failed on rank(s) {failed}"
                raise RuntimeError(message + ("" if failure is None else f": {failure!r}")) from failure
            rows_at[batch_size] = rows
            return max(row[0] for row in rows)

        start = per_device_batch_size(trainer) or 1
        with probe.session(pl_module, trainer):
            search = search_batch_size(measure, start, self.low, self.high, max_batch, self.max_probes)
        self.measured = [row[0] for row in rows_at.get(search.batch, [])]
        self.measured_reserved = [row[1] for row in rows_at.get(search.batch, [])]
        budget = f"{probe.cap_bytes / 2**20:.0f} MiB of {probe.kind}"
        decision = decide_batch_size(search, self.low, self.high, self.measured, budget, self.measured_reserved)
        self._apply(trainer, self._decide(decision).value)

    def _apply(self, trainer: L.Trainer, batch_size: int) -> None:
        set_per_device_batch_size(trainer, batch_size)
        self.batch_size = batch_size

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size} if self.batch_size is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Restored after setup and before the loaders exist: the resumed fit continues at its own batch.
        saved = state_dict.get("batch_size")
        if saved is not None and saved != self.batch_size and self._trainer is not None:
            self._apply(self._trainer, saved)
            self._decide(Decision("per_device_batch_size", saved, "kept from the checkpoint this fit resumes"))
