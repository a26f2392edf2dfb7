"""WarmupScaledLR: the learning rate scaled to the global batch, with gradual warmup. See docs/lr-scaling.md."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.callbacks.lr.groups import ScaledParamGroups, lr_names
from lightning_solo.callbacks.lr.schedule import LRSchedule, ScheduleOptions, total_optimizer_steps
from lightning_solo.core.batch_size import global_batch
from lightning_solo.core.checks import check_int
from lightning_solo.core.decision import Decision, DecisionLog


class WarmupScaledLR(DecisionLog, Callback):
    """Scale every param group's lr to the global batch and warm up to it (arguments: docs/lr-scaling.md)."""

    def __init__(
        self,
        rule: str = "linear",
        reference_batch_size: int = 256,
        warmup_epochs: float | None = None,
        warmup_steps: int | None = None,
        warmup_fraction: float | None = None,
        start_factor: float = 1.0,
        decay: str = "none",
        decay_milestones: Sequence[float] = (),
        decay_gamma: float = 0.1,
        min_lr_factor: float = 0.0,
        per_device_batch_size: int | None = None,
        log_lr: bool = True,
    ) -> None:
        warmup = {"warmup_epochs": warmup_epochs, "warmup_steps": warmup_steps, "warmup_fraction": warmup_fraction}
        self.options = ScheduleOptions(
            rule=rule,
            reference_batch_size=reference_batch_size,
            warmup={k: v for k, v in warmup.items() if v is not None},
            start_factor=start_factor,
            decay=decay,
            decay_milestones=tuple(decay_milestones or ()),
            decay_gamma=decay_gamma,
            min_lr_factor=min_lr_factor,
        )
        check_int("per_device_batch_size", per_device_batch_size, optional=True)
        self.per_device_batch_size = per_device_batch_size
        self.log_lr = log_lr
        self.decisions: dict[str, Decision] = {}
        self.schedule: LRSchedule | None = None
        self.global_batch: int | None = None
        self.steps_per_epoch: int | None = None
        self._base_lrs: list[list[float]] | None = None  # per optimizer, per param group: the lr as configured
        self._groups: ScaledParamGroups | None = None  # the factor applied around each step, during a fit
        self._restored: dict[str, Any] | None = None
        self._names: list[list[str]] = []
        self._batch_parts: dict[str, int] = {}
        self._log = log_lr

    def _decide(self, decision: Decision) -> Decision:
        rank_zero_info(f"[WarmupScaledLR] {decision}")
        return super()._decide(decision)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before any LearningRateMonitor (it reads the lr at batch start); an earlier slot: the hook loop skips none.
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
        monitors = [i for i, cb in enumerate(callbacks) if isinstance(cb, LearningRateMonitor)]
        me = next(i for i, cb in enumerate(callbacks) if cb is self)
        if monitors and monitors[0] < me:
            callbacks.insert(monitors[0], callbacks.pop(me))
        self._log = self.log_lr and not monitors

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Runs after restore_training_state, so nothing restored later can overwrite what is set here.
        self.decisions = {}
        batch = global_batch(trainer, self.per_device_batch_size)  # per device × devices × nodes × accumulation
        if batch is None:
            raise ValueError(
                f"cannot read a batch size from the train dataloader ({type(trainer.train_dataloader).__name__}); "
                "pass WarmupScaledLR(per_device_batch_size=...) for pre-batched or combined loaders"
            )
        self._batch_parts = dict(
            per_device_batch=batch.per_device, world_size=batch.world_size, accumulate=batch.accumulate
        )
        self.global_batch = size = self._decide(batch.decision("lr_global_batch")).value
        batches = trainer.num_training_batches
        self.steps_per_epoch = None if math.isinf(batches) else math.ceil(batches / trainer.accumulate_grad_batches)
        self.schedule, decisions = self.options.build(
            size,
            total_optimizer_steps(trainer, open_ended_ok=self.options.open_ended_ok),
            self.steps_per_epoch,
        )
        for decision in decisions:
            self._decide(decision)

        groups = [list(opt.param_groups) for opt in trainer.optimizers]
        if self._restored is not None:
            user_lrs = self._resume(groups, self._restored)
            self._restored = None
        else:  # a fresh fit (also a second fit with this callback): the optimizer as configured
            self._base_lrs = [[g.get("initial_lr", g["lr"]) for g in gs] for gs in groups]
            user_lrs = [[g["lr"] for g in gs] for gs in groups]
        self._decide(Decision("lr_base", self._base_lrs, "the optimizer's lr as configured, per param group"))
        if trainer.lr_scheduler_configs:
            names = [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs]
            self._decide(Decision("lr_user_scheduler", names, "composed: each step uses its lr × the factor"))
        schedule = self.schedule
        self._groups = ScaledParamGroups(
            trainer.optimizers, user_lrs, factor=lambda: schedule.factor(trainer.global_step)
        )
        self._names = lr_names(trainer.optimizers)

    def _resume(self, groups: list[list[dict]], saved: dict[str, Any]) -> list[list[float]]:
        assert self.schedule is not None  # built in on_train_start, before this
        if [len(gs) for gs in groups] != [len(lrs) for lrs in saved["user_lrs"]]:
            raise ValueError(
                f"the checkpoint's WarmupScaledLR state has param groups {[len(x) for x in saved['user_lrs']]}, "
                f"the optimizers now have {[len(gs) for gs in groups]}"
            )
        self._base_lrs = saved["base_lrs"]
        old, new = saved["global_batch"], self.global_batch
        old_scale, new_scale = saved["scale"], self.schedule.scale
        if old != new or old_scale != new_scale:
            why = (
                f"the checkpoint was trained at global batch {old} (world size {saved['world_size']}), this run "
                f"has {new} (world size {self._batch_parts['world_size']})"
                if old != new
                else f"rule/reference batch changed from {saved['rule']}/{saved['reference_batch_size']} to "
                f"{self.options.rule}/{self.options.reference_batch_size}"
            )
            value = {"global_batch": [old, new], "scale": [old_scale, new_scale]}
            self._decide(Decision("lr_rescaled_on_resume", value, f"{why}: lr scale {old_scale:g} → {new_scale:g}"))
        return [list(lrs) for lrs in saved["user_lrs"]]

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._groups is not None:
            self._groups.apply_all()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._groups is not None:
            self._groups.apply_all()
        # Only on the batches the loggers write: each logged float is a blocking host-to-device copy on GPUs.
        if self._log and lightning_compat.should_update_logs(trainer):
            for opt, names in zip(trainer.optimizers, self._names):
                for g, name in zip(opt.param_groups, names):
                    pl_module.log(name, g["lr"], on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        # The user's lr back outside optimizer.step (a GradScaler may skip it); the step's pre-hook applies it again.
        if self._groups is not None:
            self._groups.unapply_outside_step(optimizer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._groups is not None:  # the hooks go at teardown
            self._groups.unapply_all()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._groups is not None:
            self._groups.remove()

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._groups is None or self.schedule is None:
            return {}
        return {
            "base_lrs": self._base_lrs,
            "user_lrs": self._groups.current_user_lrs(),
            "global_batch": self.global_batch,
            "scale": self.schedule.scale,
            **self._batch_parts,
            "rule": self.options.rule,
            "reference_batch_size": self.options.reference_batch_size,
            "schedule": dataclasses.asdict(self.schedule),  # for plot_schedule after a forked (notebook) fit
            "steps_per_epoch": self.steps_per_epoch,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._restored = dict(state_dict)
            if "schedule" in state_dict:  # the fit's schedule until on_train_start builds the next one
                self.schedule = LRSchedule(**state_dict["schedule"])
                self.global_batch, self.steps_per_epoch = state_dict["global_batch"], state_dict["steps_per_epoch"]
                self._base_lrs = state_dict["base_lrs"]

    def plot_schedule(
        self,
        path: str | Path,
        global_batch: int | None = None,
        total_steps: int | None = None,
        steps_per_epoch: int | None = None,
        base_lr: float | None = None,
    ) -> Path:
        """PNG of the lr over the run: the last fit's schedule, or the one for ``global_batch`` and ``total_steps``."""
        if global_batch is None and total_steps is None and self.schedule is not None:
            schedule, steps_per_epoch = self.schedule, steps_per_epoch or self.steps_per_epoch
        elif global_batch is None or total_steps is None:
            raise ValueError("before fit, plot_schedule needs global_batch and total_steps")
        else:
            schedule, _ = self.options.build(global_batch, total_steps, steps_per_epoch)
        if base_lr is None:
            base_lr = self._base_lrs[0][0] if self._base_lrs else 1.0
        try:
            from matplotlib.figure import Figure  # not pyplot: leaves the user's backend (a notebook's) alone
        except ImportError as err:
            raise ImportError(
                "plot_schedule needs matplotlib, an optional dependency: pip install 'lightning_solo[plot]'"
            ) from err
        steps = list(range(schedule.total_steps))
        xs = [s / steps_per_epoch for s in steps] if steps_per_epoch else steps
        fig = Figure(figsize=(6, 3.2), dpi=120)
        ax = fig.subplots()
        ax.plot(xs, [base_lr * schedule.factor(s) for s in steps], lw=1.6)
        ax.axhline(base_lr, color="grey", lw=0.8, ls=":", label=f"base lr {base_lr:g}")
        if schedule.warmup_steps:
            end = schedule.warmup_steps / steps_per_epoch if steps_per_epoch else schedule.warmup_steps
            ax.axvline(end, color="tab:orange", lw=0.8, ls="--", label="end of warmup")
        ax.set_xlabel("epoch" if steps_per_epoch else "optimizer step")
        ax.set_ylabel("learning rate")
        batch = global_batch or self.global_batch
        ax.set_title(
            f"{self.options.rule} scaling ×{schedule.scale:g} for global batch {batch}, warmup {schedule.warmup_steps} steps"
        )
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        return path
