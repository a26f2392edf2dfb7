"""The precision rule: ``"auto"`` agreed by all ranks from what their devices can run, SoloDDP's choice against
``Trainer(precision=...)`` (:func:`decide_precision`, a Decision), and the GradScaler settings, validated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_solo.core.checks import check_bool, check_choice, check_int, check_number
from lightning_solo.core.decision import Decision
from lightning_solo.core.ranks import world_size

PRECISIONS = ("auto", "bf16-mixed", "16-mixed", "32-true")
SCALER_DEFAULTS: dict[str, float | int] = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
}
# Trainer(precision=None) becomes "32-true" inside Lightning, so an explicit "32-true" looks the same.
_TRAINER_DEFAULT = "32-true"


def scaler_settings(scaler: Mapping[str, Any] | None = None) -> dict[str, float | int]:
    """Validate GradScaler settings and fill in torch's defaults for the missing ones."""
    given = dict(scaler or {})
    if unknown := sorted(set(given) - set(SCALER_DEFAULTS)):
        raise ValueError(f"unknown GradScaler setting(s) {unknown}; accepted: {list(SCALER_DEFAULTS)}")
    s = {**SCALER_DEFAULTS, **given}
    for key in ("init_scale", "growth_factor", "backoff_factor"):
        check_number(f"scaler {key}", s[key], positive=False)
    if s["init_scale"] <= 0:
        raise ValueError(f"scaler init_scale must be > 0, got {s['init_scale']!r}")
    if s["growth_factor"] <= 1:
        raise ValueError(f"scaler growth_factor must be > 1, got {s['growth_factor']!r}")
    if not 0 < s["backoff_factor"] < 1:
        raise ValueError(f"scaler backoff_factor must be in (0, 1), got {s['backoff_factor']!r}")
    interval = check_int("scaler growth_interval", s["growth_interval"])
    return {**{k: float(s[k]) for k in ("init_scale", "growth_factor", "backoff_factor")}, "growth_interval": interval}


def auto_rule(device_type: str, bf16_supported: bool) -> Decision:
    """``"auto"``: bf16-mixed on a GPU with bf16, 16-mixed on other GPUs, else 32-true (CPU autocast: ask for it)."""
    if device_type == "cuda" and bf16_supported:
        return Decision("precision", "bf16-mixed", "auto: the GPU supports bf16 (no loss scaling needed)")
    if device_type == "cuda":
        return Decision("precision", "16-mixed", "auto: the GPU lacks bf16, so fp16 with a GradScaler")
    return Decision("precision", "32-true", f"auto: fp32 on {device_type} (set 'bf16-mixed'/'16-mixed' to opt in)")


# What a rank's device can run, ordered: a job runs the lowest level any of its ranks has.
CAPABILITIES = ("32-true", "16-mixed", "bf16-mixed")


def device_capability(device: torch.device) -> int:
    """This device's index in :data:`CAPABILITIES`: bf16 on a GPU with native bf16, fp16 on others, fp32 elsewhere."""
    if device.type != "cuda":
        return 0
    with torch.cuda.device(device):
        return 2 if torch.cuda.is_bf16_supported(including_emulation=False) else 1


def agreed_rule(levels: list[int]) -> Decision:
    """The ``"auto"`` rule for a job whose rank ``r`` has capability ``levels[r]``: :func:`auto_rule` at the lowest
    level, the same on every rank (DDP must not average loss-scaled fp16 gradients with unscaled bf16 ones)."""
    level = min(levels)
    decision = auto_rule("cuda" if level else "cpu", level == 2)
    if len(levels) == 1:
        return decision
    if len(set(levels)) == 1:
        return Decision("precision", decision.value, f"{decision.reason}; the same on all {len(levels)} ranks")
    lowest = [rank for rank, have in enumerate(levels) if have == level]
    shown = f"{lowest[:8]}{' ...' if len(lowest) > 8 else ''}"
    reason = f"{decision.reason}; the lowest capability of {len(levels)} ranks (rank(s) {shown} cannot do more)"
    return Decision("precision", decision.value, reason)


def capabilities(device: torch.device, capability: int | None = None) -> list[int]:
    """Every rank's :func:`device_capability` (or ``capability``, for this rank), by rank: a collective."""
    levels = [device_capability(device) if capability is None else capability]
    if (world := world_size()) > 1:
        mine = torch.tensor(levels, device=device)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        levels = torch.cat(gathered).tolist()  # once, at setup
    return levels


def auto_precision(device: torch.device, capability: int | None = None) -> Decision:
    """:func:`agreed_rule` over :func:`capabilities` (a collective: call it on every rank)."""
    return agreed_rule(capabilities(device, capability))


def decide_precision(
    requested: str | None, trainer_precision: str, device: torch.device, capability: int | None = None
) -> Decision:
    """The precision from SoloDDP's and the Trainer's (docs/precision.md); ``ValueError`` if both are set and differ."""
    if requested is None:
        return Decision("precision", trainer_precision, "Trainer(precision=...); SoloDDP(precision=None) defers")
    trainer_explicit = None if trainer_precision == _TRAINER_DEFAULT else trainer_precision
    if requested == "auto":
        if trainer_explicit is None:
            return auto_precision(device, capability)
        if trainer_explicit not in PRECISIONS:
            raise ValueError(
                f"SoloDDP(precision='auto') can defer to Trainer(precision=...) only for {PRECISIONS[1:]}, got "
                f"{trainer_explicit!r}; use SoloDDP(precision=None) to leave that precision to Lightning"
            )
        return Decision("precision", trainer_explicit, "Trainer(precision=...) given; SoloDDP 'auto' defers to it")
    if trainer_explicit not in (None, requested):
        raise ValueError(
            f"Trainer(precision={trainer_explicit!r}) and SoloDDP(precision={requested!r}) disagree; set one of "
            "them, or the same value on both"
        )
    return Decision("precision", requested, "set on SoloDDP")


@dataclass(frozen=True)
class _Options:
    precision: str | None
    scaler: dict[str, float | int] = field(default_factory=dict)
    scaler_given: bool = False
    skip_lr_on_overflow: bool = False


def precision_options(
    precision: str | None, scaler: Mapping[str, Any] | None, skip_lr_on_overflow: bool, plugin: Any = None
) -> _Options:
    """Validate SoloDDP's precision arguments once, at construction (``plugin``: its ``precision_plugin=``)."""
    if precision is not None and plugin is not None:
        raise ValueError("pass either precision= or precision_plugin= to SoloDDP, not both")
    if precision is not None:
        check_choice("precision", precision, PRECISIONS, " (or None to leave it to the Trainer)")
    check_bool("skip_lr_on_overflow", skip_lr_on_overflow)
    return _Options(precision, scaler_settings(scaler), scaler is not None and len(scaler) > 0, skip_lr_on_overflow)
