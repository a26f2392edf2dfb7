""":class:`SoloMixedPrecision` (with SoloDDP or alone, ``Trainer(plugins=[...])``), configurable and resume-safe, and
how SoloDDP settles the plugin once the device is known. See docs/precision.md."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo._compat import torch as torch_compat
from lightning_solo._compat.patch import Patches
from lightning_solo.core.decision import Decision, DecisionLog
from lightning_solo.ddp.precision.rule import _TRAINER_DEFAULT, _Options, decide_precision, scaler_settings

# The key Lightning's own plugin (its class qualname) saves the scaler under: resume works both ways with stock.
CHECKPOINT_KEY = MixedPrecision.__qualname__
EXTRA_KEY = "lightning_solo.precision"  # a checkpoint key (the format), not the module path


class SoloMixedPrecision(DecisionLog, MixedPrecision):
    """Lightning's :class:`MixedPrecision` with a configurable (``scaler``), resume-safe GradScaler and skip counting;
    ``skip_lr_on_overflow``: hold step-interval LR schedulers on a skipped step (one host sync per step)."""

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        device: str,
        scaler: Mapping[str, Any] | None = None,
        skip_lr_on_overflow: bool = False,
    ) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(f"SoloMixedPrecision precision must be '16-mixed' or 'bf16-mixed', got {precision!r}")
        settings = scaler_settings(scaler)
        fp16 = precision == "16-mixed"
        grad_scaler = torch.amp.GradScaler(device, **settings) if fp16 else None  # type: ignore[arg-type]
        super().__init__(precision, device, grad_scaler)
        self.scaler_settings = settings if grad_scaler is not None else {}
        self.skip_lr_on_overflow = bool(skip_lr_on_overflow)
        self.decisions: dict[str, Decision] = {}
        self._skipped: Tensor | None = None  # stays on the device: counting must not sync
        self._skipped_before = 0  # restored from a checkpoint
        self._last_step_skipped = False
        self._guarded: tuple[nn.Module, Patches] | None = None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/nan gradients, including those before a resume."""
        return self._skipped_before + (int(self._skipped.item()) if self._skipped is not None else 0)

    @override
    def optimizer_step(  # type: ignore[override]  # Lightning's own signature, unlike fabric's
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        scale = torch_compat.scaler_scale(self.scaler)  # made by the first scale(); the saved one after a resume
        before = scale.clone() if scale is not None else torch_compat.scaler_init_scale(self.scaler)
        output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        after = torch_compat.scaler_scale(self.scaler)
        if after is None:  # no backward ran (training_step returned None)
            return output
        # update() multiplies the scale by backoff_factor < 1 exactly when it skipped the step.
        skipped = (after < before).float()
        self._skipped = skipped if self._skipped is None else self._skipped + skipped
        if self.skip_lr_on_overflow:
            self._guard_lr_schedulers(model)
            self._last_step_skipped = bool(skipped)
        if getattr(model, "_current_fx_name", None) and not model.trainer.barebones:
            model.log_dict(
                {"amp/skipped_steps": self._skipped, "amp/scale": after.detach()}, on_step=True, on_epoch=False
            )
        return output

    def _guard_lr_schedulers(self, module: pl.LightningModule) -> None:
        # Lightning steps schedulers through the module's lr_scheduler_step hook: wrapped until teardown.
        if self._guarded is not None and self._guarded[0] is module:
            return
        self._unguard()
        original = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            if self._last_step_skipped and _interval(module, scheduler) == "step":
                return None
            return original(scheduler, metric)

        patches = Patches()
        patches.set(module, "lr_scheduler_step", lr_scheduler_step)
        self._guarded = (module, patches)

    def _unguard(self) -> None:
        if self._guarded is not None:
            self._guarded[1].close()
            self._guarded = None

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is None:
            return
        configured = {k: self.scaler_settings[k] for k in ("growth_factor", "backoff_factor", "growth_interval")}
        changed = {k: (state_dict[k], v) for k, v in configured.items() if k in state_dict and state_dict[k] != v}
        # Keep the saved scale and growth tracker; the factors and interval are this run's configuration.
        self.scaler.load_state_dict({**state_dict, **configured})
        scale = state_dict["scale"]
        if changed:
            what = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
            reason = f"scaler settings changed since the checkpoint ({what}); kept the saved scale {scale}"
        else:
            reason = f"restored the saved scale {scale} and growth tracker"
        self._decide(Decision("grad_scaler_resume", {"scale": scale, **configured}, reason))
        rank_zero_info(f"lightning_solo: GradScaler {reason}")

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning stored state_dict() under this class's qualname: moved to the key stock Lightning reads.
        state = checkpoint.pop(type(self).__qualname__, None)
        if state:
            checkpoint[CHECKPOINT_KEY] = state
        checkpoint[EXTRA_KEY] = {"precision": self.precision, "skipped_steps": self.skipped_steps}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        extra = checkpoint.get(EXTRA_KEY, {})
        self._skipped_before, self._skipped = int(extra.get("skipped_steps", 0)), None
        state = checkpoint.get(CHECKPOINT_KEY)
        if state and self.scaler is not None:
            self.load_state_dict(state)
        elif state:
            reason = f"checkpoint has GradScaler state, unused with {self.precision}"
            self._decide(Decision("grad_scaler_resume", None, reason))
        elif self.scaler is not None and "optimizer_states" in checkpoint:
            reason = "checkpoint has no GradScaler state; starting at init_scale"
            self._decide(Decision("grad_scaler_resume", self.scaler_settings, reason))

    @override
    def teardown(self) -> None:
        self._unguard()
        super().teardown()


def _interval(module: pl.LightningModule, scheduler: Any) -> str:
    for config in module.trainer.lr_scheduler_configs:
        if config.scheduler is scheduler:
            return config.interval
    return "step"


class _PendingPrecision(Precision):
    """Stands in until the device is known, so the connector builds no plugin (on CPU: bf16) from the Trainer's flag."""

    def __init__(self, precision: str) -> None:
        self.precision = precision  # type: ignore[assignment]  # any requested value, until decided


def pending_plugin(options: _Options) -> Precision | None:
    """The plugin SoloDDP hands to Lightning at construction: a placeholder when it owns the precision."""
    return _PendingPrecision(options.precision) if options.precision is not None else None


def decide_precision_plugin(
    plugin: Precision, options: _Options, trainer: Any, device: torch.device
) -> tuple[Precision, list[Decision]]:
    """The plugin for ``device`` in place of the placeholder (or Lightning's own AMP plugin), and the decisions."""
    trainer_precision, user_plugin = lightning_compat.precision_flags(trainer, _TRAINER_DEFAULT)
    if isinstance(plugin, _PendingPrecision):
        decision = decide_precision(options.precision, trainer_precision, device)
        if decision.value == "16-mixed" and device.type == "cpu":
            decision = Decision("precision", "16-mixed", decision.reason + "; real fp16 autocast on CPU")
    elif plugin is user_plugin:
        return plugin, [Decision("precision", plugin.precision, "the plugin given to the Trainer, used as is")]
    elif type(plugin) is MixedPrecision:
        # Lightning built it from Trainer(precision=...): same precision, but resume-safe and configurable.
        decision = Decision("precision", plugin.precision, "Trainer(precision=...); resume-safe SoloDDP plugin")
        device = torch.device(plugin.device)
    elif isinstance(plugin, SoloMixedPrecision) or options.precision is not None:
        return plugin, []  # settled by an earlier fit/validate of this Trainer: keep it (and its scaler)
    else:
        return plugin, [Decision("precision", plugin.precision, "Trainer(precision=...); SoloDDP(precision=None)")]

    if decision.value == "32-true":
        new: Precision = Precision()
    else:
        new = SoloMixedPrecision(decision.value, device.type, options.scaler, options.skip_lr_on_overflow)
    decisions = [decision]
    if decision.value == "16-mixed":
        decisions.append(
            Decision("grad_scaler", options.scaler, "configured" if options.scaler_given else "torch defaults")
        )
        hold = "held" if options.skip_lr_on_overflow else "advanced"
        decisions.append(Decision("lr_on_overflow", hold, "step-interval LR schedulers on a skipped step"))
    elif options.scaler_given:
        unused = f"scaler settings unused: {decision.value} needs no loss scaling"
        decisions.append(Decision("grad_scaler", None, unused))
    return new, decisions
