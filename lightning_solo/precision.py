"""Mixed precision that is configurable, resume-safe and never switched behind your back.

Example::

    import lightning as L
    from lightning_solo import SoloDDP

    # fp16 autocast + a tuned GradScaler, on CPU or GPU (real fp16 on CPU: no silent switch to bf16)
    strategy = SoloDDP(precision="16-mixed", scaler={"init_scale": 2.0**12, "growth_interval": 500})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy)

    # the plugin alone, with any strategy
    from lightning_solo.precision import SoloMixedPrecision
    trainer = L.Trainer(plugins=[SoloMixedPrecision("16-mixed", "cpu", scaler={"growth_factor": 4.0})])

What stock Lightning lacks and this module adds (see research notes §2):

* a GradScaler configured from plain values (``init_scale``, ``growth_factor``, ``backoff_factor``,
  ``growth_interval``), validated up front;
* scaler state saved under the key ``"MixedPrecision"``, which stock Lightning reads and writes, whatever
  the plugin's class is called (Lightning keys it by class qualname, so a subclass would lose it);
* on resume the saved scale and growth tracker are kept, but the *configured* factors and interval win
  (``GradScaler.load_state_dict`` would silently restore the old ones); a change is logged;
* optimizer steps skipped for inf/nan gradients are counted, logged (``amp/skipped_steps``,
  ``amp/scale``) and checkpointed; optionally a step-interval LR scheduler is held on a skipped step;
* the precision itself is resolved once, with a reason, from ``SoloDDP(precision=...)`` and
  ``Trainer(precision=...)`` (:func:`decide_precision` states the rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_solo.decision import Decision, DecisionLog
from lightning_solo.ranks import world_size
from lightning_solo.validate import check_bool, check_int, check_number

PRECISIONS = ("auto", "bf16-mixed", "16-mixed", "32-true")
SCALER_DEFAULTS: dict[str, float | int] = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
}
# Stock Lightning writes and reads the scaler under the plugin's class qualname; "MixedPrecision" is what
# its own plugin uses, so both directions of resume (stock <-> lightning_solo) keep the scale.
CHECKPOINT_KEY = MixedPrecision.__qualname__
EXTRA_KEY = "lightning_solo.precision"
# Trainer(precision=None) becomes "32-true" inside Lightning, so an explicit "32-true" looks the same.
_TRAINER_DEFAULT = "32-true"


def scaler_settings(scaler: Mapping[str, Any] | None = None) -> dict[str, float | int]:
    """Validate GradScaler settings and fill in torch's defaults for the missing ones."""
    given = dict(scaler or {})
    unknown = sorted(set(given) - set(SCALER_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown GradScaler setting(s) {unknown}; accepted: {list(SCALER_DEFAULTS)}")
    s = {**SCALER_DEFAULTS, **given}
    for key in ("init_scale", "growth_factor", "backoff_factor"):
        v = s[key]
        check_number(f"scaler {key}", v, positive=False)
    if s["init_scale"] <= 0:
        raise ValueError(f"scaler init_scale must be > 0, got {s['init_scale']!r}")
    if s["growth_factor"] <= 1:
        raise ValueError(f"scaler growth_factor must be > 1, got {s['growth_factor']!r}")
    if not 0 < s["backoff_factor"] < 1:
        raise ValueError(f"scaler backoff_factor must be in (0, 1), got {s['backoff_factor']!r}")
    interval = check_int("scaler growth_interval", s["growth_interval"])
    return {
        "init_scale": float(s["init_scale"]),
        "growth_factor": float(s["growth_factor"]),
        "backoff_factor": float(s["backoff_factor"]),
        "growth_interval": interval,
    }


def auto_rule(device_type: str, bf16_supported: bool) -> Decision:
    """The ``"auto"`` rule: bf16-mixed on a GPU that supports bf16, 16-mixed on a GPU without it, and
    32-true on CPU and other devices (CPU autocast is rarely faster; ask for it explicitly)."""
    if device_type == "cuda" and bf16_supported:
        return Decision("precision", "bf16-mixed", "auto: the GPU supports bf16 (no loss scaling needed)")
    if device_type == "cuda":
        return Decision("precision", "16-mixed", "auto: the GPU lacks bf16, so fp16 with a GradScaler")
    return Decision(
        "precision", "32-true", f"auto: fp32 on {device_type} (set 'bf16-mixed'/'16-mixed' to opt in)"
    )


# What a rank's device can run, ordered: a job runs the lowest level any of its ranks has.
CAPABILITIES = ("32-true", "16-mixed", "bf16-mixed")


def device_capability(device: torch.device) -> int:
    """This device's index in :data:`CAPABILITIES`: bf16 on a GPU that has it natively, fp16 on other GPUs,
    fp32 elsewhere."""
    if device.type != "cuda":
        return 0
    with torch.cuda.device(device):
        return 2 if torch.cuda.is_bf16_supported(including_emulation=False) else 1


def agreed_rule(levels: list[int]) -> Decision:
    """The ``"auto"`` rule for a job whose rank ``r`` has capability ``levels[r]``: :func:`auto_rule` at the
    lowest level, the same on every rank. A job spanning A100 and V100 nodes thus runs fp16 + GradScaler
    everywhere: DDP must not average loss-scaled fp16 gradients with unscaled bf16 ones."""
    level = min(levels)
    decision = auto_rule("cuda" if level else "cpu", level == 2)
    if len(levels) == 1:
        return decision
    if len(set(levels)) == 1:
        return Decision("precision", decision.value, f"{decision.reason}; the same on all {len(levels)} ranks")
    lowest = [rank for rank, have in enumerate(levels) if have == level]
    shown = f"{lowest[:8]}{' ...' if len(lowest) > 8 else ''}"
    return Decision(
        "precision",
        decision.value,
        f"{decision.reason}; the lowest capability of {len(levels)} ranks (rank(s) {shown} cannot do more)",
    )


def auto_precision(device: torch.device, capability: int | None = None) -> Decision:
    """:func:`agreed_rule` over every rank's :func:`device_capability` (or ``capability``, for this rank): a
    collective when a process group of several ranks exists, so call it on every rank, after the group."""
    levels = [device_capability(device) if capability is None else capability]
    if (world := world_size()) > 1:
        mine = torch.tensor(levels, device=device)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        levels = torch.cat(gathered).tolist()  # once, at setup
    return agreed_rule(levels)


def decide_precision(
    requested: str | None, trainer_precision: str, device: torch.device, capability: int | None = None
) -> Decision:
    """Decide the run's precision from ``SoloDDP(precision=requested)`` and ``Trainer(precision=...)``.

    The rule:

    * ``requested=None``: the Trainer decides, as in stock Lightning (default ``"32-true"``).
    * a concrete ``requested`` (``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"``) is used; if the Trainer
      was given a *different* explicit precision, this raises ``ValueError`` instead of letting one of them
      win silently.
    * ``requested="auto"`` defers to an explicit Trainer precision and otherwise applies :func:`auto_rule` to the
      lowest capability of all ranks (:func:`auto_precision`, a collective).
    * ``Trainer(precision="32-true")`` cannot be told apart from the Trainer's default, so it counts as
      "not set": ``SoloDDP(precision="bf16-mixed")`` with it runs bf16 and ``"auto"`` applies its rule.
    """
    if requested is None:
        return Decision(
            "precision", trainer_precision, "Trainer(precision=...); SoloDDP(precision=None) defers"
        )
    trainer_explicit = None if trainer_precision == _TRAINER_DEFAULT else trainer_precision
    if requested == "auto":
        if trainer_explicit is None:
            return auto_precision(device, capability)
        if trainer_explicit not in PRECISIONS:
            raise ValueError(
                f"SoloDDP(precision='auto') can defer to Trainer(precision=...) only for {PRECISIONS[1:]}, got "
                f"{trainer_explicit!r}; use SoloDDP(precision=None) to leave that precision to Lightning"
            )
        return Decision(
            "precision", trainer_explicit, "Trainer(precision=...) given; SoloDDP 'auto' defers to it"
        )
    if trainer_explicit not in (None, requested):
        raise ValueError(
            f"Trainer(precision={trainer_explicit!r}) and SoloDDP(precision={requested!r}) disagree; set one of "
            "them, or the same value on both"
        )
    return Decision("precision", requested, "set on SoloDDP")


def to_channels_last(module: nn.Module) -> nn.Module:
    """Store 4-D weights NHWC, which cuDNN's fp16/bf16 convolution kernels prefer (often 10-30% faster)."""
    return module.to(memory_format=torch.channels_last)


class SoloMixedPrecision(DecisionLog, MixedPrecision):
    """Lightning's :class:`MixedPrecision` with a configurable, resume-safe GradScaler and skip counting.

    Example::

        plugin = SoloMixedPrecision("16-mixed", "cpu", scaler={"init_scale": 1024, "growth_interval": 100},
                                    skip_lr_on_overflow=True)
        trainer = L.Trainer(accelerator="cpu", plugins=[plugin])
        trainer.fit(model)
        print(plugin.skipped_steps, plugin.scaler.get_scale())

    Args:
        precision: ``"16-mixed"`` (fp16 autocast + GradScaler) or ``"bf16-mixed"`` (no scaler).
        device: the autocast device type, ``"cuda"``, ``"cpu"``, ...
        scaler: GradScaler settings (``init_scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``); missing ones take torch's defaults. Ignored for bf16.
        skip_lr_on_overflow: hold step-interval LR schedulers on a step the scaler skipped, so the schedule
            follows real updates. Costs one host sync per optimizer step.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        device: str,
        scaler: Mapping[str, Any] | None = None,
        skip_lr_on_overflow: bool = False,
    ) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(
                f"SoloMixedPrecision precision must be '16-mixed' or 'bf16-mixed', got {precision!r}"
            )
        settings = scaler_settings(scaler)
        grad_scaler = torch.amp.GradScaler(device, **settings) if precision == "16-mixed" else None
        super().__init__(precision, device, grad_scaler)
        self.scaler_settings = settings if grad_scaler is not None else {}
        self.skip_lr_on_overflow = bool(skip_lr_on_overflow)
        self.decisions: dict[str, Decision] = {}
        self._skipped: Tensor | None = None  # stays on the device: counting must not sync
        self._skipped_before = 0  # restored from a checkpoint
        self._last_step_skipped = False
        self._guarded: tuple[nn.Module, Any] | None = None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/nan gradients, including those before a resume."""
        return self._skipped_before + (int(self._skipped.item()) if self._skipped is not None else 0)

    @override
    def optimizer_step(self, optimizer, model, closure, **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        scale = self.scaler._scale  # created lazily by the first scale(); the saved scale after a resume
        before = scale.clone() if scale is not None else self.scaler._init_scale
        output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if self.scaler._scale is None:  # no backward ran (training_step returned None)
            return output
        # update() multiplies the scale by backoff_factor < 1 exactly when it skipped the step.
        skipped = (self.scaler._scale < before).float()
        self._skipped = skipped if self._skipped is None else self._skipped + skipped
        if self.skip_lr_on_overflow:
            self._guard_lr_schedulers(model)
            self._last_step_skipped = bool(skipped)
        if getattr(model, "_current_fx_name", None) and not model.trainer.barebones:
            model.log_dict(
                {"amp/skipped_steps": self._skipped, "amp/scale": self.scaler._scale.detach()},
                on_step=True,
                on_epoch=False,
            )
        return output

    def _guard_lr_schedulers(self, module: nn.Module) -> None:
        # Lightning steps schedulers through the module's lr_scheduler_step hook right after the optimizer
        # step; wrapping that hook (on the instance, undone in teardown) is the one seam it offers.
        if self._guarded is not None and self._guarded[0] is module:
            return
        original = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            if self._last_step_skipped and _interval(module, scheduler) == "step":
                return None
            return original(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step
        self._guarded = (module, original)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is None:
            return
        configured = {
            k: self.scaler_settings[k] for k in ("growth_factor", "backoff_factor", "growth_interval")
        }
        changed = {
            k: (state_dict[k], v) for k, v in configured.items() if k in state_dict and state_dict[k] != v
        }
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
        # Lightning just stored state_dict() under our qualname; move it to the key stock Lightning reads.
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
            self._decide(Decision(
                "grad_scaler_resume", None, f"checkpoint has GradScaler state, unused with {self.precision}"
            ))
        elif self.scaler is not None and "optimizer_states" in checkpoint:
            self._decide(Decision(
                "grad_scaler_resume", self.scaler_settings, "checkpoint has no GradScaler state; starting at init_scale"
            ))

    @override
    def teardown(self) -> None:
        if self._guarded is not None:
            module, _ = self._guarded
            module.__dict__.pop("lr_scheduler_step", None)
            self._guarded = None
        super().teardown()


def _interval(module: nn.Module, scheduler: Any) -> str:
    for config in module.trainer.lr_scheduler_configs:
        if config.scheduler is scheduler:
            return config.interval
    return "step"


@dataclass(frozen=True)
class _Options:
    precision: str | None
    scaler: dict[str, float | int] = field(default_factory=dict)
    scaler_given: bool = False
    skip_lr_on_overflow: bool = False


def precision_options(
    precision: str | None, scaler: Mapping[str, Any] | None, skip_lr_on_overflow: bool
) -> _Options:
    """Validate SoloDDP's precision arguments once, at construction."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not one of {PRECISIONS} (or None to leave it to the Trainer)"
        )
    check_bool("skip_lr_on_overflow", skip_lr_on_overflow)
    return _Options(
        precision, scaler_settings(scaler), scaler is not None and len(scaler) > 0, skip_lr_on_overflow
    )


class _PendingPrecision(Precision):
    """Stands in on the strategy until its device is known; it keeps the connector from building (and on
    CPU silently bf16-converting) its own plugin from ``Trainer(precision=...)``."""

    def __init__(self, precision: str) -> None:
        self.precision = precision  # type: ignore[assignment]


def pending_plugin(options: _Options) -> Precision | None:
    """The plugin SoloDDP hands to Lightning at construction: a placeholder when it owns the precision."""
    return _PendingPrecision(options.precision) if options.precision is not None else None


def decide_precision_plugin(
    plugin: Precision, options: _Options, trainer: Any, device: torch.device
) -> tuple[Precision, list[Decision]]:
    """Replace the placeholder (or Lightning's own AMP plugin) with the real plugin for ``device``.

    Returns the plugin to use and the decisions made. Called by SoloDDP once the device is known.
    """
    connector = getattr(trainer, "_accelerator_connector", None)
    trainer_precision = getattr(connector, "_precision_flag", _TRAINER_DEFAULT)
    user_plugin = getattr(connector, "_precision_plugin_flag", None)
    if isinstance(plugin, _PendingPrecision):
        decision = decide_precision(options.precision, trainer_precision, device)
        if decision.value == "16-mixed" and device.type == "cpu":
            decision = Decision("precision", "16-mixed", decision.reason + "; real fp16 autocast on CPU")
    elif plugin is user_plugin:
        return plugin, [
            Decision("precision", plugin.precision, "the plugin given to the Trainer, used as is")
        ]
    elif type(plugin) is MixedPrecision:
        # Lightning built it from Trainer(precision=...): same precision, but resume-safe and configurable.
        decision = Decision(
            "precision", plugin.precision, "Trainer(precision=...); resume-safe SoloDDP plugin"
        )
        device = torch.device(plugin.device)
    elif isinstance(plugin, SoloMixedPrecision) or options.precision is not None:
        return plugin, []  # settled by an earlier fit/validate of this Trainer: keep it (and its scaler)
    else:
        return plugin, [
            Decision("precision", plugin.precision, "Trainer(precision=...); SoloDDP(precision=None)")
        ]

    if decision.value == "32-true":
        new: Precision = Precision()
    else:
        new = SoloMixedPrecision(decision.value, device.type, options.scaler, options.skip_lr_on_overflow)
    decisions = [decision]
    if decision.value == "16-mixed":
        decisions.append(
            Decision(
                "grad_scaler", options.scaler, "configured" if options.scaler_given else "torch defaults"
            )
        )
        hold = "held" if options.skip_lr_on_overflow else "advanced"
        decisions.append(Decision("lr_on_overflow", hold, "step-interval LR schedulers on a skipped step"))
    elif options.scaler_given:
        decisions.append(
            Decision("grad_scaler", None, f"scaler settings unused: {decision.value} needs no loss scaling")
        )
    return new, decisions
