"""The loss against its running trend and across ranks: pure arithmetic on LossWatch's numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_solo.diagnostics.checks.finding import Finding

_REMEDIES = (
    "warm the learning rate up (WarmupScaledLR(warmup_steps=...)), lower it or scale it properly for the global "
    "batch (WarmupScaledLR(rule='sqrt') for Adam-like optimizers, the optimizer's lr), and clip gradients "
    "(Trainer(gradient_clip_val=1.0))"
)


@dataclass
class LossTrend:
    """Moving averages of the loss and its deviation, and the spikes, climbs, see-saw seen (docs/diagnostics.md)."""

    window: int = 50
    spike_factor: float = 2.0
    spike_sigmas: float = 4.0
    rise: float = 0.25
    seesaw: float = -0.6
    mean: float | None = None
    var: float = 0.0
    lag_cov: float = 0.0
    count: int = 0
    lowest: tuple[float, int] | None = None
    events: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)
    _last_dev: float = 0.0
    _climbing: bool = False

    STATE = ("mean", "var", "lag_cov", "count", "lowest", "events", "_last_dev", "_climbing")

    def state_dict(self) -> dict:
        """The running averages and the events seen: plain numbers, loadable with ``weights_only=True``."""
        state = {name: getattr(self, name) for name in self.STATE}
        return {**state, "events": {kind: list(seen) for kind, seen in self.events.items()}}

    def load_state_dict(self, state: dict) -> None:
        for name in self.STATE:
            setattr(self, name, state[name])
        self.events = {kind: [tuple(e) for e in seen] for kind, seen in state["events"].items()}
        if self.lowest is not None:  # a tuple again, whatever sequence the saved state held
            self.lowest = (self.lowest[0], self.lowest[1])

    def update(self, step: int, loss: float) -> str | None:
        """Fold in one step's loss; the kind of event it shows (``"spike"``, ``"climb"``, ``"seesaw"``) or ``None``."""
        if not math.isfinite(loss):
            return None
        if self.mean is None:
            self.mean, self.count = loss, 1
            return None
        alpha = 2.0 / (self.window + 1)
        dev = loss - self.mean
        settled = self.count >= self.window
        spike = self.mean > 0 and loss > self.spike_factor * self.mean and dev > self.spike_sigmas * math.sqrt(self.var)
        event = "spike" if settled and spike else None
        self.mean += alpha * dev
        self.var = (1 - alpha) * (self.var + alpha * dev * dev)
        self.lag_cov = (1 - alpha) * self.lag_cov + alpha * dev * self._last_dev
        self._last_dev, self.count = dev, self.count + 1
        if settled:
            if self.lowest is None or self.mean < self.lowest[0]:
                self.lowest, self._climbing = (self.mean, step), False
            elif 0 < self.lowest[0] * (1 + self.rise) < self.mean and not self._climbing:
                self._climbing, event = True, event or "climb"
            # 4 standard errors (~1/sqrt(window) each) below zero too, so a short window never cries wolf.
            seesaw = self.var > 0 and self.lag_cov / self.var < min(self.seesaw, -4 / math.sqrt(self.window))
            if seesaw and self.mean > 0 and "seesaw" not in self.events:
                event = event or "seesaw"
        if event is not None:
            self.events.setdefault(event, []).append((step, loss, self.mean))
        return event

    def advice(self) -> dict[str, str]:
        """One line per kind of event seen (``"spike"``, ...), with the fix."""
        lines = {}
        if spikes := self.events.get("spike"):
            step, loss, trend = spikes[0]
            lines["spike"] = (
                f"the loss spiked {len(spikes)} time(s) above {self.spike_factor:g}x its running trend (first at "
                f"step {step}: {loss:.4g} against {trend:.4g}): {_REMEDIES}."
            )
        if climbs := self.events.get("climb"):
            step, _, trend = climbs[0]
            low, low_step = self.lowest or (trend, step)
            lines["climb"] = (
                f"the loss trend climbed back {100 * (trend / low - 1):.0f}% above its lowest ({low:.4g} at step "
                f"{low_step}, {trend:.4g} at step {step}): the learning rate is likely too high; {_REMEDIES}."
            )
        if seesaw := self.events.get("seesaw"):
            lines["seesaw"] = (
                f"the loss see-saws from step to step around its trend (from step {seesaw[0][0]}): each step "
                f"overshoots; {_REMEDIES}."
            )
        return lines


def rank_spread(
    means: Sequence[float],
    variances: Sequence[float],
    counts: Sequence[int],
    *,
    first_step: int,
    last_step: int,
    threshold: float = 0.1,
    z_min: float = 6.0,
) -> Finding | None:
    """A warning when the ranks' mean losses (``means[r]``, ...: rank r's over the same steps) differ by more
    than ``threshold`` of their mean and by more than ``z_min`` standard errors; else ``None``."""
    ranks = [r for r, n in enumerate(counts) if n > 0 and math.isfinite(means[r])]
    if len(ranks) < 2:
        return None
    low, high = min(ranks, key=lambda r: means[r]), max(ranks, key=lambda r: means[r])
    overall = sum(means[r] * counts[r] for r in ranks) / sum(counts[r] for r in ranks)
    spread = means[high] - means[low]
    error = math.sqrt(variances[high] / counts[high] + variances[low] / counts[low])
    if abs(overall) < 1e-12 or spread / abs(overall) <= threshold or spread <= z_min * error:
        return None
    return Finding(
        "loss.rank_spread",
        f"over steps {first_step}-{last_step} rank {high} averaged a loss of {means[high]:.4g} and rank {low} "
        f"{means[low]:.4g} ({100 * spread / abs(overall):.0f}% of the mean, far beyond step-to-step noise): the "
        "ranks see differently distributed data. Check the sampler and shuffling: a DistributedSampler with "
        "shuffle=True (Trainer(use_distributed_sampler=True) adds one), a dataset ordered by label and cut into "
        "contiguous shards, or per-rank data files.",
        ranks=(high, low),
    )
