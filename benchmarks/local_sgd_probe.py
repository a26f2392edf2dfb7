"""Where post-local-SGD's time goes on the communication-bound MLP of ``compare --sections comm``: the same
runs with no averaging at all (period 10⁶), with Lightning's per-batch SIGTERM broadcast instead of SoloDDP's
asynchronous agreement, with the unused-parameter policy off, and with period 4.

Usage::

    python -m benchmarks.local_sgd_probe        # 2 rounds, ~3 min on 2 cores
"""

import statistics
import sys

from benchmarks import compare


def main(argv: list[str] | None = None) -> None:
    args = compare.parse_args(["--rounds", "2", *(argv if argv is not None else sys.argv[1:])])
    spec = compare.base_spec(args, workload="mlp", batch=8, batches=96, warmup=16, lr=0.01)
    solo = {**spec, "kind": "solo"}
    local = {"comm_hook": "post_local_sgd", "local_sgd_warmup": 16}
    contenders = {
        "no-communication ceiling": ({**spec, "kind": "ceiling"}, 2),
        "SoloDDP() exact": (solo, 2),
        "post_local_sgd, never averaging": ({**solo, "solo": {**local, "local_sgd_period": 10**6}}, 2),
        "… with Lightning's per-batch SIGTERM broadcast": (
            {**solo, "solo": {**local, "local_sgd_period": 10**6}, "ablate": ["lightning_sigterm_check"]},
            2,
        ),
        "… and find_unused_parameters=False": (
            {**solo, "solo": {**local, "local_sgd_period": 10**6, "find_unused_parameters": False}},
            2,
        ),
        "post_local_sgd, period 4": ({**solo, "solo": {**local, "local_sgd_period": 4}}, 2),
    }
    res = compare.interleave(contenders, args.rounds, args.timeout, args.pause)
    print(compare.machine_line())
    print("| run | samples/s | CPU ms per batch |\n|---|---|---|")
    for name in contenders:
        sps, cpu = statistics.median(compare.sps(res[name])), statistics.median(compare.cpu(res[name]))
        print(f"| {name} | {sps:.1f} | {cpu:.1f} |")


if __name__ == "__main__":
    main()
