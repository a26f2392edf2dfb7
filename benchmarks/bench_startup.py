"""A process's start: ``import lightning_solo`` (the cyclic GC paused while Lightning loads) against the same modules
with Lightning imported first (the GC running throughout, as before the pause), in fresh interpreters.

Every rank of a run, every loader worker started by spawn and every ``python -m lightning_solo.run`` pays its start.
The two arms alternate within each round (the order flips every round); the figures are medians over rounds of the
CPU time (user + system) and wall time of each child, and the median of the per-round ratios with a bootstrap
interval.

``--freeze`` compares the import followed by ``gc.freeze()`` (what ``python -m lightning_solo.run`` and
``python -m lightning_solo.evaluate`` do first) against the import alone: the start and the interpreter's exit.

``--with-site DIR`` compares another pair: the same import as installed against the same import with ``DIR`` on
``PYTHONPATH`` (e.g. a ``pip install --target DIR scipy``: what an optional package that torchmetrics imports when it
finds it costs every process).

Usage::

    python -m benchmarks.bench_startup              # 10 rounds, ~3 min on 2 cores
    python -m benchmarks.bench_startup --rounds 20 --module lightning_solo.app.run
    python -m benchmarks.bench_startup --module lightning_solo.app.run --freeze
    pip install --no-deps --target /tmp/scipy_site scipy
    python -m benchmarks.bench_startup --module lightning_solo.app.run --with-site /tmp/scipy_site
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

from benchmarks.stats import median_interval


def _start(code: str, site: str | None = None) -> tuple[float, float]:
    """CPU seconds (user + system) and wall seconds of ``python -c code`` in a fresh interpreter (``site`` first on
    its ``PYTHONPATH``)."""
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{code!r} failed:\n{proc.stderr}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--module", default="lightning_solo", help="what the process imports")
    parser.add_argument("--with-site", help="compare the import as installed against it with this on PYTHONPATH")
    parser.add_argument("--freeze", action="store_true", help="compare the import then gc.freeze() against it alone")
    args = parser.parse_args(argv)
    code = f"import {args.module}"
    # (name, code, site): the first arm is the one measured, the second the one it is compared against.
    if args.freeze:
        arms = [("frozen", f"{code}; import gc; gc.freeze()", None), ("not frozen", code, None)]
    elif args.with_site:
        arms = [("installed", code, None), (f"with {args.with_site}", code, args.with_site)]
    else:  # lightning_solo's __init__ imports Lightning with the GC paused; Lightning first: the GC runs throughout
        arms = [("GC paused", code, None), ("GC running", f"import lightning.pytorch; {code}", None)]
    _start(arms[0][1])  # warm the page cache and the bytecode caches before the first timed round
    cpu: list[list[float]] = [[], []]
    wall: list[list[float]] = [[], []]
    for r in range(args.rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            c, w = _start(*arms[i][1:])
            cpu[i].append(c)
            wall[i].append(w)
        print(f"round {r + 1}/{args.rounds}: CPU {arms[0][0]} {cpu[0][-1]:.2f} s, {arms[1][0]} {cpu[1][-1]:.2f} s")
    a, b = arms[0][0], arms[1][0]
    print(f"\n`{code}`, {args.rounds} rounds, medians (per-round ratio {a} / {b}, 95 % interval)\n")
    print(f"| figure | {a} | {b} | ratio |\n|---|---|---|---|")
    for name, values in (("CPU s (user + system)", cpu), ("wall s", wall)):
        ratios = [p / q for p, q in zip(*values, strict=True)]
        low, high = median_interval(ratios)
        print(
            f"| {name} | {statistics.median(values[0]):.2f} | {statistics.median(values[1]):.2f} | "
            f"{statistics.median(ratios):.3f} ({low:.3f}–{high:.3f}) |"
        )


if __name__ == "__main__":
    main()
