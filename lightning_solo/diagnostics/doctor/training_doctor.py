"""TrainingDoctor: where every rank's time goes and what bounds the run, measured live. See docs/diagnostics.md."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import psutil
import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.data import extract_batch_size
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_solo.core.batch_size import per_device_batch_size
from lightning_solo.core.checks import check_int, check_number
from lightning_solo.core.decision import Decision, DecisionLog
from lightning_solo.ddp.strategy import SoloDDP
from lightning_solo.diagnostics.checks.setup_checks import cores_per_process
from lightning_solo.diagnostics.doctor.report import (
    OWN_PHASES,
    format_table,
    gather_ranks,
    plot_doctor,
    series,
    summarize,
    write_json,
)
from lightning_solo.diagnostics.doctor.timing import ExposedComm, StepTimer
from lightning_solo.diagnostics.doctor.verdict import Setup
from lightning_solo.diagnostics.loss_watch import LossWatch

_MIB = 2**20
_RSS_EVERY = 64  # steps between RSS samples on CPU (psutil: 50-200 µs)


def decide_sample_rate(requested: int | None, device: torch.device) -> Decision:
    """How often DDP's reducer times an iteration: every one on CPU; DDP's 1 in 100 on CUDA (its timer syncs)."""
    if requested is not None:
        return Decision("ddp_runtime_logging_sample_rate", requested, "given to TrainingDoctor")
    if device.type == "cuda":
        return Decision("ddp_runtime_logging_sample_rate", 100, "DDP's default, every 100th: its CUDA timer syncs")
    return Decision("ddp_runtime_logging_sample_rate", 1, "DDP times every iteration (its default: every 100th)")


class TrainingDoctor(DecisionLog, L.Callback):
    """What bounds the run and what to change, measured on every rank (arguments: docs/diagnostics.md)."""

    def __init__(
        self,
        every_n_steps: int | None = None,
        warmup_steps: int = 3,
        reference_throughput: float | None = None,
        ddp_sample_rate: int | None = None,
        filename: str = "doctor.json",
        chart: str | None = "doctor.png",
        loss_watch: bool | LossWatch = True,
    ) -> None:
        self.every_n_steps = check_int("every_n_steps", every_n_steps, optional=True)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
        self.reference_throughput = check_number("reference_throughput", reference_throughput, optional=True)
        self.ddp_sample_rate = check_int("ddp_sample_rate", ddp_sample_rate, optional=True)
        self.filename, self.chart = filename, chart
        self.decisions: dict[str, Decision] = {}
        self.report: dict[str, Any] | None = None  # the end-of-training report (every rank)
        self.reports: list[dict[str, Any]] = []  # the periodic ones
        self.files: dict[str, str | None] = {}  # what rank 0 wrote
        self.loss_watch = LossWatch() if loss_watch is True else (loss_watch or None)
        self._watch: LossWatch | None = None  # the loss watch this fit drives (None: another callback does)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        standalone = any(isinstance(cb, LossWatch) for cb in trainer.callbacks)  # type: ignore[attr-defined]
        self._watch = None if standalone else self.loss_watch
        if self._watch is not None:
            self._watch.on_train_start(trainer, pl_module)
            self.decisions.update(self._watch.decisions)
        try:
            expected = float(trainer.estimated_stepping_batches)
        except Exception:  # noqa: BLE001 - a loader Lightning cannot size: warm up in full
            expected = math.inf
        rate = self._decide(decide_sample_rate(self.ddp_sample_rate, pl_module.device)).value
        # Chart bins of 16 steps (DDP's logging data is read once per bin), narrower for short runs.
        bin_steps = max(1, min(16, int(expected) // 64)) if math.isfinite(expected) else 16
        self._timer = StepTimer(pl_module.device, ExposedComm(rate), bin_steps=bin_steps)
        self._timer.comm.watch(trainer.strategy.model)  # then at every batch end
        if isinstance(trainer.strategy, SoloDDP):  # a re-wrap: the old wrapper read out before it is dropped
            trainer.strategy.add_rewrap_listener(self._timer.comm.read_out)
        self._warmup = min(self.warmup_steps, int(expected) // 4 if math.isfinite(expected) else self.warmup_steps)
        self._steps, self._first_step = 0, trainer.global_step + self._warmup
        self.report, self.reports, self.files = None, [], {}
        self._process, self._rss = psutil.Process(), 0
        self._phase_s: dict[str, float] = {}  # this rank's heartbeat phase times at the last report
        if pl_module.automatic_optimization:
            self._timer.loss_scale = trainer.accumulate_grad_batches
        if self._warmup == 0:
            self._timer.start()

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._timer.batch_start()

    @override
    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._watch is not None:
            self._watch.on_before_backward(trainer, pl_module, loss)

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._watch is not None:  # a non-finite loss stops every rank (see LossWatch)
            self._watch.on_before_optimizer_step(trainer, pl_module, optimizer)
        self._timer.before_optimizer()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        loss = loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None
        # SoloDDP re-wraps in its on_train_batch_start, after the callbacks': the new wrapper is seen here.
        self._timer.comm.watch(trainer.strategy.model)
        if not self._timer.batch_end(_samples(batch), loss):
            return
        self._steps += 1
        if self._steps == self._warmup:
            self._timer.start()
        if self._steps % _RSS_EVERY == 0:
            self._sample_rss()
        if self.every_n_steps and self._timer.recording and trainer.global_step % self.every_n_steps == 0:
            self.reports.append(self._report(trainer, pl_module, "window"))

    @override
    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.training:  # not the sanity check before training
            self._timer.skip_gap()

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if trainer.training:
            self._timer.skip_gap()

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"loss_watch": self._watch.state_dict()} if self._watch is not None else {}
        if self.report is not None:
            state["results"] = {"report": self.report, "reports": self.reports, "files": self.files}
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_watch is not None and "loss_watch" in state_dict:
            self.loss_watch.load_state_dict(state_dict["loss_watch"])
        if results := state_dict.get("results"):
            self.report, self.reports, self.files = results["report"], results["reports"], results["files"]

    @property
    def advice(self) -> list[str]:
        """The advice of the loss watch this doctor drives."""
        return self._watch.advice if self._watch is not None else []

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._watch is not None:  # its last step's check, still in flight
            self._watch.on_train_end(trainer, pl_module)
        self.report = self._report(trainer, pl_module, "total", final=True)
        self._timer.comm.release()  # the DDP wrapper is not ours to keep

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, which: str, final: bool = False) -> dict:
        """Gather every rank's sums (a collective), judge, log and write (rank 0)."""
        window = self._timer.take_window()
        self._sample_rss()
        extra = {**self._memory(trainer, pl_module), **self._phases(trainer, which)}
        gathered = gather_ranks(window, self._timer.total, self._timer.bins, extra, pl_module.device)
        report = summarize(gathered, which, self._setup(trainer, pl_module), self.reference_throughput)
        report["global_step"] = trainer.global_step
        if trainer.is_global_zero:
            title = "TrainingDoctor" if final else f"TrainingDoctor @ step {trainer.global_step}"
            rank_zero_info(format_table(report, title))
            self._write(Path(trainer.default_root_dir), report, gathered, final)
        return report

    def _write(self, root: Path, report: dict, gathered: list[dict[str, Any]], final: bool) -> None:
        """doctor.json (the reports so far and the per-bin series) and, at the end, doctor.png."""
        steps = [self._first_step + end for end in self._timer.bin_ends]
        content: dict[str, Any] = {
            "final": report if final else None,
            "periodic": [*self.reports, *([] if final else [report])],
            "warmup_steps": self._warmup,
            "series": series(gathered, steps),
        }
        chart = None
        if final and self.chart and steps:
            chart = plot_doctor(content["series"], root / self.chart)
            if chart is None:
                rank_zero_info("TrainingDoctor: no chart (pip install 'lightning_solo[plot]' for matplotlib)")
        self.files = {"json": str(root / self.filename), "chart": str(chart) if chart else None}
        content["files"] = self.files
        write_json(content, root / self.filename)

    def _phases(self, trainer: L.Trainer, which: str) -> dict[str, float]:
        """This rank's seconds per phase by SoloDDP's heartbeat, since the last report ("window") or in all."""
        strategy = trainer.strategy
        beat = strategy.heartbeats().get(trainer.global_rank) if isinstance(strategy, SoloDDP) else None
        if beat is None:
            return {}
        now = {f"phase_s:{p}": beat.phase_s.get(p, 0.0) for p in OWN_PHASES}
        last, self._phase_s = self._phase_s, now
        return now if which == "total" else {k: v - last.get(k, 0.0) for k, v in now.items()}

    def _sample_rss(self) -> None:
        if not self._timer.cuda:
            self._rss = max(self._rss, self._process.memory_info().rss)

    def _memory(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """This rank's peak and total memory, and its idle cores."""
        device = pl_module.device
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            total = torch.cuda.get_device_properties(device).total_memory
        else:
            peak, total = self._rss, psutil.virtual_memory().total
        idle = cores_per_process(trainer.num_devices) - 1 - _workers(trainer)
        return {"peak_memory_mib": peak / _MIB, "memory_total_mib": total / _MIB, "idle_cores": max(0, idle)}

    def _setup(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Setup:
        loader, workers = trainer.train_dataloader, _workers(trainer)
        hook = trainer.strategy.comm_hook if isinstance(trainer.strategy, SoloDDP) else None
        return Setup(
            device=pl_module.device.type,
            world_size=trainer.world_size,
            per_device_batch=per_device_batch_size(trainer),
            accumulate=trainer.accumulate_grad_batches,
            num_workers=workers,
            pin_memory=bool(getattr(loader, "pin_memory", False)),
            prefetch_factor=getattr(loader, "prefetch_factor", None) if workers else None,
            comm_hook=getattr(hook, "name", None),
            hook_times_ms=getattr(hook, "measured_ms", None) or None,
            precision=str(trainer.precision),
            **self._timer.comm.layout(),
        )


def _samples(batch: Any) -> int:
    """The batch's size: the first dimension of its first tensor; 1 when it holds none."""
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return len(first)
    try:
        return extract_batch_size(batch)
    except Exception:  # noqa: BLE001 - a batch with no tensor in it: counted as one sample
        return 1


def _workers(trainer: L.Trainer) -> int:
    loader = trainer.train_dataloader
    return loader.num_workers if isinstance(loader, DataLoader) else 0
