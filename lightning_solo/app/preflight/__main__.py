"""``python -m lightning_solo.preflight``: check this machine, or every rank of an allocation when started by
torchrun or srun, before a long job. Exit status 0 when it passes, 2 when it does not (on every rank)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from lightning_solo.app.preflight.machine import check_machine, format_report, launch_placement

FAILED_EXIT = 2  # as the runner's exit status for bad input


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_solo.preflight", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, help="process-group backend (default: nccl on GPU, gloo on CPU)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for every rank to join")
    parser.add_argument("--strict", action="store_true", help="fail on warnings too")
    parser.add_argument("--ignore", action="append", default=[], help="a fact allowed to differ (repeatable)")
    parser.add_argument("--json", default=None, help="also write the facts and findings to this file (rank 0)")
    args = parser.parse_args(argv)
    try:
        every, findings = check_machine(args.backend, args.timeout, args.ignore)
    except Exception as err:  # noqa: BLE001 - a rank that could not join the others: say why, on this rank
        print(f"lightning_solo preflight: FAILED on this rank: {err}", file=sys.stderr)
        return FAILED_EXIT
    rank = launch_placement()[0]
    failed = [f for f in findings if f.error or args.strict]
    if rank == 0:
        print(format_report(every, findings))
        if args.json:
            data = {"ranks": [asdict(f) for f in every], "findings": [asdict(f) for f in findings]}
            Path(args.json).write_text(json.dumps(data, indent=2, default=str))
    elif failed:  # every rank says why it exits non-zero: its log may be the one read
        print("\n".join(f"lightning_solo preflight: {f}" for f in failed), file=sys.stderr)
    return FAILED_EXIT if failed else 0


if __name__ == "__main__":
    sys.exit(main())
