"""WarmupScaledLR's lr multiplier as pure math, and the options it is built from. See docs/lr-scaling.md."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import lightning.pytorch as pl

from lightning_solo.core.checks import check_int
from lightning_solo.core.decision import Decision

RULES = ("linear", "sqrt", "none")
DECAYS = ("none", "cosine", "step")
DEFAULT_WARMUP_FRACTION = 0.05


def _check_choice(what: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"unknown {what} {value!r}; accepted: {', '.join(accepted)}")


def scale_factor(rule: str, global_batch: int, reference_batch: int) -> float:
    """How much the lr grows when the global batch grows from ``reference_batch`` to ``global_batch``."""
    ratio = global_batch / reference_batch
    return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


@dataclass(frozen=True)
class LRSchedule:
    """The base lr's multiplier per optimizer step; ``start_factor`` capped at ``scale`` (warmup never lowers it)."""

    scale: float
    warmup_steps: int
    total_steps: int
    start_factor: float = 1.0
    decay: str = "none"
    min_factor: float = 0.0
    milestones: Sequence[int] = field(default_factory=tuple)
    gamma: float = 0.1

    @property
    def start(self) -> float:
        """The multiplier at step 0 when warming up."""
        return min(self.start_factor, self.scale)

    def factor(self, step: int) -> float:
        """The multiplier for the optimizer step with 0-based index ``step``."""
        if step < self.warmup_steps:
            return self.start + (self.scale - self.start) * step / self.warmup_steps
        return self.scale * self._decay(step)

    def _decay(self, step: int) -> float:
        if self.decay == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return self.min_factor + (1.0 - self.min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.decay == "step":
            return self.gamma ** sum(step >= m for m in self.milestones)
        return 1.0


@dataclass(frozen=True)
class ScheduleOptions:
    """WarmupScaledLR's schedule arguments, checked when made; ``warmup``: the one warmup argument given, if any."""

    rule: str = "linear"
    reference_batch_size: int = 256
    warmup: dict[str, float] = field(default_factory=dict)
    start_factor: float = 1.0
    decay: str = "none"
    decay_milestones: tuple[float, ...] = ()
    decay_gamma: float = 0.1
    min_lr_factor: float = 0.0

    def __post_init__(self) -> None:
        _check_choice("lr scaling rule", self.rule, RULES)
        _check_choice("decay", self.decay, DECAYS)
        check_int("reference_batch_size", self.reference_batch_size)
        warmup, milestones = self.warmup, list(self.decay_milestones)
        if len(warmup) > 1:
            raise ValueError(f"give at most one of warmup_epochs, warmup_steps, warmup_fraction; got {warmup}")
        if any(v < 0 for v in warmup.values()):
            raise ValueError(f"warmup length must be >= 0, got {warmup}")
        if warmup.get("warmup_fraction", 0) > 1:
            raise ValueError(f"warmup_fraction is a fraction of the run in [0, 1], got {warmup['warmup_fraction']!r}")
        steps = warmup.get("warmup_steps")
        if steps is not None and int(steps) != steps:
            raise ValueError(f"warmup_steps must be a whole number of optimizer steps, got {steps!r}")
        if milestones and (sorted(milestones) != milestones or not all(0 < m < 1 for m in milestones)):
            raise ValueError(f"decay_milestones are increasing fractions of the run in (0, 1), got {milestones!r}")
        if self.decay == "step" and not milestones:
            raise ValueError("decay='step' needs decay_milestones, e.g. [0.33, 0.67, 0.89] (fractions of the run)")
        if not self.start_factor >= 0.0:
            raise ValueError(f"start_factor must be >= 0, got {self.start_factor!r}")
        if not 0.0 <= self.min_lr_factor <= 1.0:
            raise ValueError(f"min_lr_factor must be in [0, 1], got {self.min_lr_factor!r}")
        if not 0.0 < self.decay_gamma <= 1.0:
            raise ValueError(f"decay_gamma must be in (0, 1], got {self.decay_gamma!r}")

    @property
    def warmup_kind(self) -> tuple[str, float]:
        return next(iter(self.warmup.items()), ("warmup_fraction", DEFAULT_WARMUP_FRACTION))

    @property
    def open_ended_ok(self) -> bool:
        """A run with no fixed length is fine: warmup in steps and no decay need no run length."""
        return self.warmup_kind[0] == "warmup_steps" and self.decay == "none"

    def build(
        self, global_batch: int, total_steps: int, steps_per_epoch: int | None
    ) -> tuple[LRSchedule, list[Decision]]:
        """The schedule for a run of ``total_steps`` optimizer steps at ``global_batch``, and why."""
        scale = scale_factor(self.rule, global_batch, self.reference_batch_size)
        why = {
            "linear": f"linear rule: {global_batch} / {self.reference_batch_size}",
            "sqrt": f"sqrt rule: √({global_batch} / {self.reference_batch_size})",
            "none": "rule 'none'",
        }[self.rule]
        decisions = [Decision("lr_scale", round(scale, 6), why)]

        kind, amount = self.warmup_kind
        warmup = warmup_length(kind, amount, total_steps, steps_per_epoch)
        schedule = LRSchedule(
            scale=scale,
            warmup_steps=warmup,
            total_steps=total_steps,
            start_factor=self.start_factor,
            decay=self.decay,
            min_factor=self.min_lr_factor,
            gamma=self.decay_gamma,
            milestones=tuple(round(m * total_steps) for m in self.decay_milestones),
        )
        origin = "set by the user" if self.warmup else "default: 5% of the run"
        reason = f"{kind}={amount} ({origin}) of {total_steps} optimizer steps; from {schedule.start:g}× to {scale:g}× the configured lr"
        decisions.append(Decision("lr_warmup_steps", warmup, reason))
        if self.decay != "none":
            detail = (
                f"to {self.min_lr_factor:g}× at step {total_steps}"
                if self.decay == "cosine"
                else f"× {self.decay_gamma:g} at steps {list(schedule.milestones)}"
            )
            decisions.append(Decision("lr_decay", self.decay, f"after warmup, {detail}"))
        return schedule, decisions


def warmup_length(kind: str, amount: float, total_steps: int, steps_per_epoch: int | None) -> int:
    """Optimizer steps of warmup for ``kind`` (``warmup_steps``/``warmup_epochs``/``warmup_fraction``) ``amount``."""
    if kind == "warmup_steps":
        warmup = int(amount)
    elif kind == "warmup_epochs":
        if steps_per_epoch is None:
            raise ValueError("warmup_epochs needs a train dataloader with a length; use warmup_steps instead")
        warmup = round(amount * steps_per_epoch)
    else:
        warmup = round(amount * total_steps)
    if warmup > total_steps:
        raise ValueError(
            f"warmup ({kind}={amount} → {warmup} optimizer steps) is longer than the run "
            f"({total_steps} optimizer steps); shorten the warmup or train longer"
        )
    return warmup


def total_optimizer_steps(trainer: pl.Trainer, open_ended_ok: bool) -> int:
    """The optimizer steps of the whole fit from where the loop stands; endless if ``open_ended_ok``, else raises."""
    total = trainer.estimated_stepping_batches
    if math.isinf(total):
        if not open_ended_ok:
            raise ValueError(
                "the run has no fixed length (max_epochs=-1, max_steps=-1): set max_steps, or use "
                "warmup_steps with decay='none'"
            )
        return 2**62
    batches, max_epochs = trainer.num_training_batches, trainer.max_epochs
    if max_epochs is not None and max_epochs >= 0 and not math.isinf(batches):
        # After a resume at another world size, done steps had other epoch lengths; the epoch restarts on new shards.
        per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        by_epochs = (
            trainer.global_step
            + math.ceil(max(0, batches - done) / trainer.accumulate_grad_batches)
            + (max_epochs - trainer.current_epoch - 1) * per_epoch
        )
        total = by_epochs if trainer.max_steps < 0 else min(trainer.max_steps, by_epochs)
    return int(total)
