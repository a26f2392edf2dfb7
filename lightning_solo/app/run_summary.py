"""RunSummary: time the training, then print and save the run summary on rank 0: one dict (JSON) and a table, read
from the running objects, not the config."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_solo.app.remedies import remedy_rows, with_config_keys
from lightning_solo.core.batch_size import global_batch
from lightning_solo.diagnostics.doctor.verdict import setting_call


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
        # the lr this step uses (a scheduler callback may change it by batch end)
        lr = float(optimizer.param_groups[0]["lr"])
        self._lr.setdefault("first_step", lr)
        self._lr["peak"] = max(lr, self._lr.get("peak", lr))
        self._lr["last_step"] = lr

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # not on_train_end: the strategy's end-of-training advice and decisions exist by now
        timing = {
            "train_seconds": self._train_seconds,
            "wall_seconds": time.perf_counter() - getattr(self, "_train_started", time.perf_counter()),
            "samples_seen": self._samples,
            "samples_per_second": self._samples / self._train_seconds if self._train_seconds else 0.0,
        }
        summary = build_summary(trainer, timing, dict(self._lr))
        if trainer.is_global_zero:
            self.summary = summary
            path = Path(trainer.default_root_dir, self.filename)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary, indent=2, default=str))
            rank_zero_info(format_summary(summary))

    @override
    def state_dict(self) -> dict[str, Any]:
        # empty until the fit has ended; a forked fit's summary comes back to the notebook through it
        return {"summary": self.summary} if self.summary is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.summary = state_dict.get("summary", self.summary)


def collect_decisions(trainer: L.Trainer) -> list[dict[str, Any]]:
    """Every owner's decisions, one per setting (the strategy also relays its precision plugin's)."""
    found: dict[str, dict[str, Any]] = {}
    for owner in (trainer.strategy, trainer.precision_plugin, *trainer.callbacks):  # type: ignore[attr-defined]
        for decision in (getattr(owner, "decisions", None) or {}).values():
            found[decision.setting] = decision.as_dict()
    return list(found.values())


def collect_advice(trainer: L.Trainer) -> list[str]:
    """The strategy's advice, then each callback's, with the runner's config keys for the settings it names."""
    lines: list[str] = []
    for owner in (trainer.strategy, *trainer.callbacks):  # type: ignore[attr-defined]
        lines += [line for line in getattr(owner, "advice", None) or [] if line not in lines]
    return [with_config_keys(line) for line in lines]


def doctor_summary(trainer: L.Trainer) -> dict[str, Any] | None:
    """TrainingDoctor's files, verdict and remedies with the runner's overrides (None without a doctor)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        files = getattr(callback, "files", None)
        if files and "json" in files:
            verdict = (getattr(callback, "report", None) or {}).get("verdict") or {}
            return {**files, "bound": verdict.get("bound"), "remedies": remedy_rows(verdict.get("remedies") or [])}
    return None


def build_summary(trainer: L.Trainer, timing: dict[str, float], lr: dict[str, float]) -> dict[str, Any]:
    strategy = trainer.strategy
    settings = strategy.settings() if hasattr(strategy, "settings") else {"strategy": type(strategy).__name__}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    ckpt = trainer.checkpoint_callback
    batch = global_batch(trainer)
    return {
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "devices_per_node": trainer.world_size // max(1, trainer.num_nodes),
        "cluster_environment": type(getattr(strategy, "cluster_environment", None)).__name__,
        "accelerator": type(trainer.accelerator).__name__,
        "precision": trainer.precision,
        "strategy": type(strategy).__name__,
        "strategy_settings": settings,
        "decisions": collect_decisions(trainer),
        "advice": collect_advice(trainer),
        "doctor": doctor_summary(trainer),
        "per_device_batch": batch.per_device if batch else None,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "global_batch": batch.size if batch else None,
        "lr": lr,
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
        **timing,
        "metrics": metrics,
        "val_acc": metrics.get("val/acc"),
        "checkpoint_last": getattr(ckpt, "last_model_path", None) or None,
        "checkpoint_best": getattr(ckpt, "best_model_path", None) or None,
        "log_dir": trainer.log_dir,
        "output_dir": trainer.default_root_dir,
    }


def format_summary(summary: dict[str, Any]) -> str:
    def fmt(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    rows = [
        (
            "world size",
            f"{summary['world_size']} = {summary['num_nodes']} node(s) × {summary['devices_per_node']} device(s)"
            f" ({summary['accelerator']}, {summary['cluster_environment']})",
        ),
        ("strategy", summary["strategy"]),
        *((f"  {k}", fmt(v)) for k, v in summary["strategy_settings"].items()),
        ("precision", summary["precision"]),
        ("batch per device", fmt(summary["per_device_batch"])),
        ("global batch", f"{summary['global_batch']} (accumulate {summary['accumulate_grad_batches']})"),
        ("learning rate", ", ".join(f"{k} {fmt(v)}" for k, v in summary["lr"].items()) or "-"),
        ("steps / epochs", f"{summary['global_step']} / {summary['epochs']}"),
        ("train time", f"{fmt(summary.get('train_seconds', 0.0))} s"),
        ("throughput", f"{fmt(summary.get('samples_per_second', 0.0))} samples/s (all ranks)"),
        ("val accuracy", fmt(summary["val_acc"]) if summary["val_acc"] is not None else "-"),
        ("checkpoint", summary["checkpoint_last"] or summary["checkpoint_best"] or "-"),
        ("logs", summary["log_dir"] or "-"),
    ]
    rows += [("decision", f"{d['setting']} = {d['value']!r}: {d['reason']}") for d in summary["decisions"]]
    rows += [("advice", line) for line in summary["advice"]]
    if doctor := summary.get("doctor"):
        bound = f"{doctor['bound']}-bound: " if doctor.get("bound") else ""
        rows.append(("doctor", bound + ", ".join(p for p in (doctor["json"], doctor.get("chart")) if p)))
        for r in doctor.get("remedies") or []:
            where = r.get("override") or setting_call(r.get("setting"), r.get("value"))
            rows.append(("remedy", f"{where}: {r['action']} (~{r['gain']:.0%} of the step)"))
    width = max(len(k) for k, _ in rows)
    lines = ["", "=" * 30 + " lightning_solo run summary " + "=" * 30]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("=" * 88)
    return "\n".join(lines)
