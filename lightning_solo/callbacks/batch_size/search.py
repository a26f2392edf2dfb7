"""The search for the per-device batch whose peak memory lands in a target band (pure). See docs/diagnostics.md."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_solo.core.checks import check_int, check_number
from lightning_solo.core.decision import Decision

GROWTH_LIMIT = 4  # the next probe is at most this many times the largest batch that fitted


@dataclass
class Search:
    """The chosen ``batch``, its measured ``fraction``, whether that is ``in_band``, and every probe made."""

    batch: int
    fraction: float
    in_band: bool
    probes: list[tuple[int, float]] = field(default_factory=list)


def check_band(fraction: float, tolerance: float) -> tuple[float, float]:
    """``(fraction - tolerance, fraction + tolerance)``, checked to lie within (0, 1]."""
    check_number("fraction", fraction)
    check_number("tolerance", tolerance, positive=False)
    low, high = fraction - tolerance, fraction + tolerance
    if not (0 < low <= fraction <= high <= 1):
        raise ValueError(
            f"fraction ± tolerance must lie within (0, 1], got {fraction!r} ± {tolerance!r} = [{low:g}, {high:g}]"
        )
    return low, high


def _line_guess(points: list[tuple[int, float]], target: float) -> int | None:
    (b1, f1), (b2, f2) = points
    if b1 == b2 or f2 == f1 or not (math.isfinite(f1) and math.isfinite(f2)):
        return None
    slope = (f2 - f1) / (b2 - b1)
    return round(b1 + (target - f1) / slope) if slope > 0 else None


def search_batch_size(
    measure: Callable[[int], float], start: int, low: float, high: float, max_batch: int, max_probes: int = 8
) -> Search:
    """Probe batches in ``[1, max_batch]`` with ``measure`` for one whose fraction is in ``[low, high]``; else
    the largest batch measured at or below ``high``, or 1."""
    check_int("max_batch", max_batch)
    check_int("max_probes", max_probes)
    target = (low + high) / 2
    measured: dict[int, float] = {}
    batch = min(max(1, start), max_batch)
    for _ in range(max_probes):
        measured[batch] = fraction = measure(batch)
        if low <= fraction <= high:
            break
        fits = [b for b, f in measured.items() if f <= high]
        misses = [b for b, f in measured.items() if f > high]
        lo, hi = max(fits, default=0), min(misses, default=max_batch + 1)
        if hi - lo <= 1:
            break  # no batch between the largest fit and the smallest miss (or the limits)
        finite = sorted((b, f) for b, f in measured.items() if math.isfinite(f))
        bracket = [(lo, measured[lo]), (hi, measured[hi])] if lo and hi in measured else finite[-2:]
        guess: int | None
        if len(finite) < 2 or bracket[0][0] == bracket[-1][0]:  # one point: memory taken as proportional
            guess = round(batch * target / fraction) if math.isfinite(fraction) and fraction > 0 else batch // 2
        else:
            guess = _line_guess(bracket, target)
        if guess is None:
            guess = (lo + hi) // 2 if hi in measured else 2 * lo
        # Strictly between the largest fit and the smallest miss; beyond anything measured, a bounded step.
        ceiling = hi - 1 if hi in measured else min(max_batch, GROWTH_LIMIT * max(lo, 1))
        batch = max(lo + 1, min(guess, ceiling))
        if batch in measured:
            break
    in_band = [b for b, f in measured.items() if low <= f <= high]
    fits = [b for b, f in measured.items() if f <= high]
    chosen = min(in_band, key=lambda b: (abs(measured[b] - target), -b)) if in_band else max(fits, default=1)
    return Search(chosen, measured.get(chosen, math.inf), bool(in_band), list(measured.items()))


def decide_batch_size(
    search: Search, low: float, high: float, per_rank: list[float], budget: str, reserved: list[float] | None = None
) -> Decision:
    """The Decision for ``search``: the batch, what every rank measured for it, the band and the probes."""
    shares = ", ".join(f"{f:.3f}" for f in per_rank)
    if reserved and all(math.isfinite(r) for r in reserved):
        shares += f" allocated ({', '.join(f'{r:.3f}' for r in reserved)} reserved)"
    probes = ", ".join(f"{b}→{f:.3f}" for b, f in search.probes)
    if search.in_band:
        verdict = f"peak memory {shares} of {budget} per rank, in the band [{low:.2f}, {high:.2f}]"
    elif math.isfinite(search.fraction) and search.fraction <= high:
        verdict = (
            f"peak memory {shares} of {budget} per rank, below the band [{low:.2f}, {high:.2f}]: the largest batch "
            "that fits in the probes (the set, max_batch_size or the probe count limits it)"
        )
    else:
        verdict = f"even batch 1 exceeds {high:.2f} of {budget}; raise the budget (cap_mb) or shrink the model"
    return Decision("per_device_batch_size", search.batch, f"{verdict}; probes (batch→largest rank's share): {probes}")
