"""LossWatch: a non-finite loss or gradient on any rank stops every rank before the optimizer step; spikes,
a climbing trend and a loss that differs between ranks become advice.

Per optimizer step, one SUM all-reduce of three numbers (this rank's loss, whether it had one, whether it or the
gradient norm is non-finite; torchtitan's MIN of a finite flag, with the mean loss in the same message): every
rank learns whether any rank failed, so all stop together, before ``optimizer.step()``, naming the step and the
rank(s) (a gather, only then, says which).
Every ``spread_every_n_steps`` steps one all-gather of each rank's mean and variance of its own losses flags
ranks that see differently distributed data. The step counts agree on every rank, so every rank runs the same
collectives.

A checkpoint keeps the trend (computed from all-reduced losses, so the same on every rank) and the advice given,
so a resumed run judges its steps as the uninterrupted run would. The rank-spread window starts afresh at the
resumed step: its losses are each rank's own, and the checkpoint is rank 0's.

Example::

    trainer = L.Trainer(strategy=SoloDDP(), callbacks=[LossWatch()])
    trainer.fit(model, dm)        # NonFiniteLossError on every rank at the first non-finite step
    trainer.callbacks[0].advice   # spikes, climbs, see-saw, rank spread, each with the fix
"""

from __future__ import annotations

import math
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
            "loss_watch.grad_norm",
            False,
            "fp16 GradScaler: it skips steps with inf gradients and lowers its scale",
        )
    return Decision(
        "loss_watch.grad_norm", True, "a non-finite gradient norm stops the run like a non-finite loss"
    )


class LossWatch(DecisionLog, L.Callback):
    """``window``: span of the running trend, in steps; ``spread_every_n_steps``: steps between rank-spread
    checks (0: never); ``spread_threshold``: the spread, as a fraction of the mean loss, worth flagging."""

    def __init__(
        self,
        check_grad_norm: bool = True,
        window: int = 50,
        spike_factor: float = 2.0,
        rise: float = 0.25,
        spread_every_n_steps: int = 50,
        spread_threshold: float = 0.1,
    ) -> None:
        self.check_grad_norm = check_bool("check_grad_norm", check_grad_norm)
        self.window = check_int("window", window)
        self.spike_factor = check_number("spike_factor", spike_factor)
        self.rise = check_number("rise", rise)
        self.spread_every_n_steps = check_int("spread_every_n_steps", spread_every_n_steps, minimum=0)
        self.spread_threshold = check_number("spread_threshold", spread_threshold)
        self.decisions: dict[str, Decision] = {}
        self._advice: dict[str, str] = {}
        self.trend = LossTrend(window=window, spike_factor=spike_factor, rise=rise)
        self._restored: dict[str, Any] | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trend = LossTrend(window=self.window, spike_factor=self.spike_factor, rise=self.rise)
        self._advice = {}
        if self._restored is not None:  # loaded from the checkpoint before this hook
            self.trend.load_state_dict(self._restored["trend"])
            self._advice, self._restored = dict(self._restored["advice"]), None
        has_scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
        self._grad_check = self._decide(decide_grad_check(self.check_grad_norm, has_scaler)).value
        self._step_loss: torch.Tensor | None = None
        self._reset_spread(trainer.global_step)

    @override
    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        # Under accumulation Lightning divides each micro-batch's loss by the count: their sum is the step's mean.
        loss = loss.detach().float().reshape(())
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        loss, self._step_loss = self._step_loss, None
        device = trainer.strategy.root_device
        grad_norm = self._grad_norm(optimizer, device) if self._grad_check else torch.zeros((), device=device)
        has_loss = loss is not None
        loss = loss.to(device) if loss is not None else torch.zeros((), device=device)
        bad = (~torch.isfinite(loss)) | (~torch.isfinite(grad_norm))
        mine = torch.stack(
            [torch.where(bad, 0.0, loss), torch.tensor(float(has_loss), device=device), bad.float()]
        )
        total = mine.clone()
        if world_size() > 1:
            dist.all_reduce(total)  # SUM: the loss over the ranks that had one, and how many ranks failed
        # One device-to-host copy for this rank's values and the sums.
        local, _, _, loss_sum, with_loss, failed = torch.cat([mine, total]).tolist()
        if failed:
            self._stop(trainer, float(loss), float(grad_norm))
        step = trainer.global_step
        if with_loss and self.trend.update(step, loss_sum / with_loss) is not None:
            for kind, line in self.trend.advice().items():
                self._advise(kind, line)
        if has_loss:
            self._losses.append(local)
        if self.spread_every_n_steps and (step + 1 - self._spread_start) >= self.spread_every_n_steps:
            self._check_spread(trainer, step)

    @override
    def state_dict(self) -> dict[str, Any]:
        # As of the last optimizer step (the trend moves only there): a save inside an accumulation cycle holds
        # no half-summed step loss, and the resume replays that cycle's batches.
        return {"trend": self.trend.state_dict(), "advice": dict(self._advice)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict

    def _grad_norm(self, optimizer, device: torch.device) -> torch.Tensor:
        # Sharded gradients (FSDP's DTensors): this rank's shard; a non-finite value shows on its own rank and the
        # all-reduced flag stops every rank.
        grads = [
            getattr(p.grad, "to_local", lambda g=p.grad: g)()
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if not grads:
            return torch.zeros((), device=device)
        return torch.nn.utils.get_total_norm(grads).to(device)

    def _stop(self, trainer: L.Trainer, loss: float, grad_norm: float) -> None:
        """Every rank is here (the all-reduce said some rank failed): gather who, then raise on every rank."""
        mine = torch.tensor([loss, grad_norm], dtype=torch.float64, device=trainer.strategy.root_device)
        every = gather_rows(mine).tolist()
        bad_loss = [r for r, (v, _) in enumerate(every) if not math.isfinite(v)]
        bad_grad = [r for r, (_, g) in enumerate(every) if not math.isfinite(g)] if self._grad_check else []
        step = trainer.global_step
        parts = []
        if bad_loss:
            parts.append(f"loss {', '.join(f'{every[r][0]}' for r in bad_loss)} on rank(s) {bad_loss}")
        if bad_grad:
            parts.append(f"gradient norm non-finite on rank(s) {bad_grad}")
        origin = bad_loss or bad_grad
        raise NonFiniteLossError(
            f"non-finite values at optimizer step {step} (epoch {trainer.current_epoch}), first on rank(s) {origin}: "
            f"{'; '.join(parts)}. Every rank stopped before the optimizer step: the weights are those after step "
            f"{step - 1}. DDP averages gradients, so one rank's NaN reaches every rank's gradients. Check that "
            f"rank's batch, then {_REMEDY}."
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
        """What the loss suggests changing, one line per kind of trouble seen (the run summary prints these)."""
        return list(self._advice.values())


_REMEDY = (
    "lower the learning rate or warm it up (WarmupScaledLR(warmup_steps=...)), clip gradients "
    "(Trainer(gradient_clip_val=1.0)), and prefer bf16 to fp16 (SoloDDP(precision='bf16-mixed'))"
)
