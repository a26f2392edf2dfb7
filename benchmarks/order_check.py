"""SoloDDP() against stock Lightning "ddp" alone, on the main section's workload (ResNet-18, 2 gloo processes).

With two contenders ``compare.interleave``'s rotation alternates who runs first (A B, B A, ...), so the
per-round ratios split by order show how much of a gap is the position in the round rather than the strategy.

Usage::

    python -m benchmarks.order_check            # 6 rounds, ~10 min on 2 cores
    python -m benchmarks.order_check --pause 20 # the same with 20 s of idle before each run
"""

import statistics
import sys

from benchmarks import compare
from benchmarks.stats import median_interval

STOCK, SOLO = 'stock Lightning "ddp"', "SoloDDP()"


def main(argv: list[str] | None = None) -> None:
    args = compare.parse_args(["--rounds", "6", *(argv if argv is not None else sys.argv[1:])])
    spec = compare.base_spec(args)
    contenders = {STOCK: ({**spec, "kind": "stock"}, 2), SOLO: ({**spec, "kind": "solo"}, 2)}
    res = compare.interleave(contenders, args.rounds, args.timeout, args.pause)
    print(compare.machine_line())
    print("| contender | samples/s | CPU ms per batch |\n|---|---|---|")
    for name in contenders:
        print(f"| {name} | {compare.spread(compare.sps(res[name]))} | {compare.spread(compare.cpu(res[name]))} |")
    for label, values in (
        ("samples/s", compare.ratios(res, SOLO, STOCK)),
        ("CPU per batch", compare.cpu_ratios(res, SOLO, STOCK)),
    ):
        solo_first, solo_second = values[1::2], values[0::2]  # round 0 runs stock first
        low, high = median_interval(values)
        print(
            f"SoloDDP/stock by {label}: all rounds {compare.spread(values, '{:.3f}')}, 95 % bootstrap interval "
            f"of the median {low:.3f}–{high:.3f}; SoloDDP first "
            f"{[round(v, 3) for v in solo_first]}, second {[round(v, 3) for v in solo_second]}; "
            f"geometric mean of the two orders' medians "
            f"{(statistics.median(solo_first) * statistics.median(solo_second)) ** 0.5:.3f}"
        )


if __name__ == "__main__":
    main()
