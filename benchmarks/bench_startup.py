"""A process's start: ``import lightning_solo`` (the cyclic GC paused while Lightning loads) against the same modules
with Lightning imported first (the GC running throughout, as before the pause), in fresh interpreters.

Every rank of a run, every loader worker started by spawn and every ``python -m lightning_solo.run`` pays its start.
The two arms alternate within each round (the order flips every round); the figures are medians over rounds of the
CPU time (user + system) and wall time of each child, and the median of the per-round ratios with a bootstrap
interval.

Usage::

    python -m benchmarks.bench_startup              # 10 rounds, ~3 min on 2 cores
    python -m benchmarks.bench_startup --rounds 20 --module lightning_solo.app.run
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

from benchmarks.stats import median_interval


def _start(code: str) -> tuple[float, float]:
    """CPU seconds (user + system) and wall seconds of ``python -c code`` in a fresh interpreter."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{code!r} failed:\n{proc.stderr}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--module", default="lightning_solo", help="what the process imports")
    args = parser.parse_args(argv)
    arms = {
        "paused": f"import {args.module}",  # lightning_solo's __init__ imports Lightning with the GC paused
        "running": f"import lightning.pytorch; import {args.module}",  # Lightning first: the GC runs throughout
    }
    _start(arms["paused"])  # warm the page cache and the bytecode caches before the first timed round
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    wall: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm in arms if r % 2 == 0 else reversed(arms):
            c, w = _start(arms[arm])
            cpu[arm].append(c)
            wall[arm].append(w)
        print(
            f"round {r + 1}/{args.rounds}: CPU paused {cpu['paused'][-1]:.2f} s, running {cpu['running'][-1]:.2f} s",
            flush=True,
        )
    print(
        f"\n`import {args.module}`, {args.rounds} rounds, medians (per-round ratio paused / running, 95 % interval)\n"
    )
    print("| figure | GC paused | GC running | ratio |\n|---|---|---|---|")
    for name, values in (("CPU s (user + system)", cpu), ("wall s", wall)):
        ratios = [p / q for p, q in zip(values["paused"], values["running"], strict=True)]
        low, high = median_interval(ratios)
        print(
            f"| {name} | {statistics.median(values['paused']):.2f} | {statistics.median(values['running']):.2f} | "
            f"{statistics.median(ratios):.3f} ({low:.3f}–{high:.3f}) |"
        )


if __name__ == "__main__":
    main()
