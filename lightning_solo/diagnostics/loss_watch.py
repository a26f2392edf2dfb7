"""LossWatch: a non-finite loss or gradient on any rank stops every rank. See docs/diagnostics.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_solo.core.checks import check_bool, check_int, check_number
from lightning_solo.core.decision import Decision, DecisionLog
from lightning_solo.core.ranks import world_size
from lightning_solo.diagnostics.checks.collectives import gather_rows
from lightning_solo.diagnostics.loss_trend import LossTrend, rank_spread


class NonFiniteLossError(FloatingPointError):
    """A loss or gradient norm was NaN or Inf on some rank; raised on every rank, before the optimizer step."""


def decide_grad_check(requested: bool, has_scaler: bool) -> Decision:
    """Whether the gradient norm is checked too: not under a GradScaler, which skips overflowed steps itself."""
    if not requested:
        return Decision("loss_watch.grad_norm", False, "set by the user")
    if has_scaler:
        return Decision(
            "loss_watch.grad_norm", False, "fp16 GradScaler: it skips steps with inf gradients and lowers its scale"
        )
    return Decision("loss_watch.grad_norm", True, "a non-finite gradient norm stops the run like a non-finite loss")


def decide_stop(stop_before_step: bool) -> Decision:
    """When the per-step check is read: at once, before the optimizer step, or one step later."""
    if stop_before_step:
        return Decision(
            "loss_watch.stop", "before the step", "set by the user: a host sync per step, the bad update never applied"
        )
    why = (
        "read one step later (no host sync): every rank stops before the next optimizer step and any checkpoint "
        "(LossWatch(stop_before_step=True): before its own update, a host sync per step)"
    )
    return Decision("loss_watch.stop", "next step", why)


@dataclass
class _Check:
    """One optimizer step's check in flight: its values copied to the host without waiting."""

    step: int
    epoch: int
    values: torch.Tensor
    ready: Any  # a CUDA event after the copy; None on the CPU (the copy was synchronous)

    @classmethod
    def start(cls, step: int, epoch: int, values: torch.Tensor) -> _Check:
        cuda = values.is_cuda
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=cuda)
        host.copy_(values, non_blocking=True)  # into pinned memory on a GPU; a plain copy on the CPU
        ready = torch.cuda.Event() if cuda else None
        if ready is not None:
            ready.record()
        return cls(step, epoch, host, ready)

    def read(self) -> list[float]:
        if self.ready is not None:
            self.ready.synchronize()  # the copy of a step ago: done long since, unless the host ran far ahead
        return self.values.tolist()


class LossWatch(DecisionLog, L.Callback):
    """Stops every rank on a non-finite loss or gradient norm (arguments: docs/diagnostics.md)."""

    def __init__(
        self,
        check_grad_norm: bool = True,
        window: int = 50,
        spike_factor: float = 2.0,
        rise: float = 0.25,
        spread_every_n_steps: int = 50,
        spread_threshold: float = 0.1,
        stop_before_step: bool = False,
    ) -> None:
        self.check_grad_norm = check_bool("check_grad_norm", check_grad_norm)
        self.window = check_int("window", window)
        self.spike_factor = check_number("spike_factor", spike_factor)
        self.rise = check_number("rise", rise)
        self.spread_every_n_steps = check_int("spread_every_n_steps", spread_every_n_steps, minimum=0)
        self.spread_threshold = check_number("spread_threshold", spread_threshold)
        self.stop_before_step = check_bool("stop_before_step", stop_before_step)
        self.decisions: dict[str, Decision] = {}
        self._advice: dict[str, str] = {}
        self.trend = LossTrend(window=window, spike_factor=spike_factor, rise=rise)
        self._restored: dict[str, Any] | None = None
        self._trainer_ref: L.Trainer | None = None
        self._pending: _Check | None = None  # the last optimizer step's check, not read yet

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trainer_ref = trainer
        self.trend = LossTrend(window=self.window, spike_factor=self.spike_factor, rise=self.rise)
        self._advice = {}
        if self._restored is not None:  # loaded from the checkpoint before this hook
            self.trend.load_state_dict(self._restored["trend"])
            self._advice, self._restored = dict(self._restored["advice"]), None
        has_scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
        self._grad_check = self._decide(decide_grad_check(self.check_grad_norm, has_scaler)).value
        self._decide(decide_stop(self.stop_before_step))
        self._step_loss: torch.Tensor | None = None
        self._pending = None
        self._reset_spread(trainer.global_step)

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        # Under accumulation Lightning divides each micro-batch's loss by the count: their sum is the step's mean.
        loss = loss.detach().float().reshape(())
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        loss, self._step_loss = self._step_loss, None
        device = trainer.strategy.root_device
        grad_norm = self._grad_norm(optimizer, device) if self._grad_check else torch.zeros((), device=device)
        has_loss = torch.full((), float(loss is not None), device=device)  # a fill on the device, no copy
        loss = loss.to(device) if loss is not None else torch.zeros((), device=device)
        bad = (~torch.isfinite(loss)) | (~torch.isfinite(grad_norm))
        mine = torch.stack([torch.where(bad, 0.0, loss), has_loss, bad.float()])
        total = mine.clone()
        if world_size() > 1:
            dist.all_reduce(total)  # SUM: the loss over the ranks that had one, and how many ranks failed
        values = torch.cat([mine, total, loss.reshape(1).float(), grad_norm.reshape(1).float()])
        check = _Check.start(trainer.global_step, trainer.current_epoch, values)
        if self.stop_before_step:
            self._settle(trainer, check)
        else:
            previous, self._pending = self._pending, check
            if previous is not None:
                self._settle(trainer, previous)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._settle_pending(trainer)

    def _settle_pending(self, trainer: L.Trainer) -> None:
        """Read the check in flight (the same sums on every rank: every rank stops or none does)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._settle(trainer, pending)

    def _settle(self, trainer: L.Trainer, check: _Check) -> None:
        local, has_loss, _, loss_sum, with_loss, failed, loss, grad_norm = check.read()
        if failed:
            self._stop(trainer, check, loss, grad_norm)
        if with_loss and self.trend.update(check.step, loss_sum / with_loss) is not None:
            for kind, line in self.trend.advice().items():
                self._advise(kind, line)
        if has_loss:
            self._losses.append(local)
        if self.spread_every_n_steps and (check.step + 1 - self._spread_start) >= self.spread_every_n_steps:
            self._check_spread(trainer, check.step)

    @override
    def state_dict(self) -> dict[str, Any]:
        # The check in flight first: a non-finite step stops the run before a save.
        if self._pending is not None and self._trainer_ref is not None:
            self._settle_pending(self._trainer_ref)
        return {"trend": self.trend.state_dict(), "advice": dict(self._advice)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict

    def _grad_norm(self, optimizer, device: torch.device) -> torch.Tensor:
        # FSDP's DTensors: this rank's shard (the all-reduced flag stops every rank).
        grads = [
            getattr(p.grad, "to_local", lambda g=p.grad: g)()
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if not grads:
            return torch.zeros((), device=device)
        return torch.nn.utils.get_total_norm(grads).to(device)

    def _stop(self, trainer: L.Trainer, check: _Check, loss: float, grad_norm: float) -> None:
        """Every rank is here (the all-reduce said some rank failed): gather who, then raise on every rank."""
        mine = torch.tensor([loss, grad_norm], dtype=torch.float64, device=trainer.strategy.root_device)
        every = gather_rows(mine).tolist()
        bad_loss = [r for r, (v, _) in enumerate(every) if not math.isfinite(v)]
        bad_grad = [r for r, (_, g) in enumerate(every) if not math.isfinite(g)] if self._grad_check else []
        step = check.step
        parts = []
        if bad_loss:
            parts.append(f"loss {', '.join(f'{every[r][0]}' for r in bad_loss)} on rank(s) {bad_loss}")
        if bad_grad:
            parts.append(f"gradient norm non-finite on rank(s) {bad_grad}")
        origin = bad_loss or bad_grad
        when = (
            f"Every rank stopped before the optimizer step: the weights are those after step {step - 1}."
            if self.stop_before_step
            else f"Every rank stopped before the next optimizer step and before any checkpoint held step {step}'s "
            f"update: resume from the newest checkpoint."
        )
        raise NonFiniteLossError(
            f"non-finite values at optimizer step {step} (epoch {check.epoch}), first on rank(s) {origin}: "
            f"{'; '.join(parts)}. {when} DDP averages gradients, so one rank's NaN reaches every rank's gradients. "
            f"Check that rank's batch, then {_REMEDY}."
        )

    def _check_spread(self, trainer: L.Trainer, step: int) -> None:
        n = len(self._losses)
        mean = sum(self._losses) / n if n else 0.0
        var = sum((x - mean) ** 2 for x in self._losses) / max(n - 1, 1)
        mine = torch.tensor([mean, var, n], dtype=torch.float64, device=trainer.strategy.root_device)
        every = gather_rows(mine).tolist()
        found = rank_spread(
            [e[0] for e in every], [e[1] for e in every], [int(e[2]) for e in every],
            first_step=self._spread_start, last_step=step, threshold=self.spread_threshold,
        )  # fmt: skip
        self._reset_spread(step + 1)
        if found is not None and "rank_spread" not in self._advice:
            self._advise("rank_spread", found.message)

    def _reset_spread(self, start: int) -> None:
        self._spread_start = start
        self._losses: list[float] = []

    def _advise(self, kind: str, line: str) -> None:
        if kind not in self._advice:  # said once; the line itself keeps its counts current
            rank_zero_warn(f"lightning_solo LossWatch: {line}")
        self._advice[kind] = line

    @property
    def advice(self) -> list[str]:
        """What the loss suggests changing, one line per kind of trouble seen."""
        return list(self._advice.values())


_REMEDY = (
    "lower the learning rate or warm it up (WarmupScaledLR(warmup_steps=...)), clip gradients "
    "(Trainer(gradient_clip_val=1.0)), and prefer bf16 to fp16 (SoloDDP(precision='bf16-mixed'))"
)
