"""The benchmarks' one statistic beyond a median: how far the median of paired per-round ratios can be trusted."""

import random
import statistics


def median_interval(values: list[float], level: float = 0.95, resamples: int = 10_000) -> tuple[float, float]:
    """A bootstrap interval for the median of ``values`` (percentile method, seeded): if it holds 1.0, the rounds
    cannot tell the two arms apart at this machine's noise."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1]
