"""What Lightning's per-batch SIGTERM broadcast costs against SoloDDP's asynchronous agreement
(:mod:`lightning_solo.ddp.sigterm`) and against no check at all, on the costs section's workload (a small CNN on
the handwritten digits, ~10 ms steps, where a per-step cost shows).

Usage::

    python -m benchmarks.sigterm_check --rounds 8    # ~6 min on 2 cores
"""

import sys

from benchmarks import compare

SOLO = "SoloDDP()"


def main(argv: list[str] | None = None) -> None:
    args = compare.parse_args(["--rounds", "8", *(argv if argv is not None else sys.argv[1:])])
    spec = compare.costs_spec(args)
    contenders = {
        SOLO: (spec, args.world_size),
        "Lightning's per-batch SIGTERM broadcast": (
            {**spec, "ablate": ["lightning_sigterm_check"]},
            args.world_size,
        ),
        "no SIGTERM check at all": ({**spec, "ablate": ["no_sigterm_check"]}, args.world_size),
    }
    res = compare.interleave(contenders, args.rounds, args.timeout, args.pause)
    print(compare.machine_line())
    print(compare.workload_line(args, args.world_size, spec))
    print("| contender | samples/s | vs SoloDDP() (per round) | CPU ms per batch | vs SoloDDP() by CPU |")
    print("|---|---|---|---|---|")
    for name in contenders:
        print(f"| {name} | {compare.versus(res, name, SOLO)} |")


if __name__ == "__main__":
    main()
