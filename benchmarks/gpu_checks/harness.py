"""gpu_check's harness: each check in a process group of its own, under its own time limit, the table rewritten
after every check.

A check is a function ``(device) -> (ok, detail)``: ``ok`` True (PASS), False (FAIL) or None (SKIP: nothing
to check here), ``detail`` one line, or a markdown table of its own (several lines, printed below the table).
The parent never imports CUDA state: it starts ``python benchmarks/gpu_check.py --check NAME`` with
``start_new_session=True``, and when the limit passes it kills the whole group (``os.killpg``: the check's
ranks, launcher children and loader workers too), so no process is left holding the GPU. It kills the group
after a normal exit as well, for any straggler, and when the run itself gets SIGTERM or SIGHUP.

``--device cpu`` (the logic without a GPU, as the test suite runs it) forks each check from this process instead
of starting an interpreter (:func:`run_forked`: the same session of its own, limit and group kill; about 5 s of
imports saved per check), except a check about its own process (``fresh``: the notebook's parent); the processes a
check starts itself are fresh interpreters either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
RESULT = "RESULT "
MIN_START_S = 15  # less left than this: a process start and a fit do not fit, the check is skipped


@dataclass(frozen=True)
class Check:
    """One row of the table: ``run(device)`` in a child process for at most ``budget_s`` seconds.

    ``cpu=False``: no CPU form (SKIP under ``--device cpu``). ``benchmark=True``: a figure, run after every
    correctness check. ``fresh=True``: a fresh interpreter on CPU too (a check about the process it runs in)."""

    name: str
    run: Callable[[str], tuple[bool | None, str]]
    budget_s: float
    cpu: bool = True
    benchmark: bool = False
    fresh: bool = False


def child_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # gloo's side groups on the loopback: a GPU host's first interface may not reach itself.
    return {**os.environ, "PYTHONPATH": path, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}


def run_group(
    cmd: Sequence[str], limit: float, env: dict[str, str] | None = None, new_session: bool = True
) -> tuple[int | None, str]:
    """Run ``cmd`` for at most ``limit`` s; (exit status, None on timeout; stdout + stderr). With ``new_session``
    (a check) its whole process group is killed when it ends, by timeout or not; without (a process a check
    starts) it stays in the check's group, which its timeout kills."""
    proc = subprocess.Popen(
        list(cmd),
        cwd=ROOT,
        env=env or child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )
    try:
        out, _ = proc.communicate(timeout=limit)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
        if not new_session:
            proc.kill()
    finally:  # also when this process is interrupted or terminated (see _terminate_as_exit): no orphan
        if new_session:
            _kill_group(proc.pid)
    if code is None:
        out, _ = proc.communicate()
    return code, out or ""


def _terminate_as_exit() -> None:
    """SIGTERM/SIGHUP (an outer timeout, a closed terminal) raise SystemExit here, so that run_group's ``finally``
    kills the running check's group: it is in a session of its own and would outlive this process otherwise."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # nothing left in it
        os.killpg(pgid, signal.SIGKILL)


def run_forked(fn: Callable[[], None], limit: float) -> tuple[int | None, str]:
    """``fn()`` in a child forked from this process, in a session of its own, for at most ``limit`` s; as
    :func:`run_group`: (exit status, None on timeout; stdout + stderr), the child's group killed when it ends."""
    from lightning_solo.core import openmp

    openmp.release_thread_pool()  # or the child could hang at its first parallel op (core/openmp.py)
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the check: output into the pipe, the exit status from fn
        status = 1
        try:
            os.setsid()
            os.close(read_end)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            # Python's streams onto the pipe too (under pytest they are its capture, not fds 1 and 2).
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the child's to its exit
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            fn()
            status = 0
        except BaseException:  # noqa: BLE001 - reported through the output, as an interpreter would
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    os.close(write_end)
    chunks, deadline, timed_out = [], time.monotonic() + limit, True
    try:
        while (left := deadline - time.monotonic()) > 0:
            if select.select([read_end], [], [], min(left, 1.0))[0]:
                if not (data := os.read(read_end, 65536)):  # every process of the group closed its output
                    timed_out = False
                    break
                chunks.append(data)
        _kill_group(pid)  # past the limit; after an exit, any straggler
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        _kill_group(pid)
        os.close(read_end)
    return None if timed_out else status, b"".join(chunks).decode(errors="replace")


def check_result(check: Check, device: str) -> None:
    """Run ``check`` here and print its RESULT line (the child's side of :func:`run_check`)."""
    ok, detail = check.run(device)
    print(RESULT + json.dumps({"ok": None if ok is None else bool(ok), "detail": detail}), flush=True)


def run_check(check: Check, device: str, limit: float, log: Path | None = None) -> dict:
    """One check in a fresh interpreter (forked from this one on CPU); returns {check, status, detail, seconds}.
    ``log``: the check's whole output is written there."""
    start = time.monotonic()
    if device == "cpu" and not check.fresh:
        code, out = run_forked(lambda: check_result(check, device), limit)
    else:
        code, out = run_group([sys.executable, str(SCRIPT), "--check", check.name, "--device", device], limit)
    if log is not None:
        log.write_text(out)
    line = next((x for x in out.splitlines() if x.startswith(RESULT)), None)
    if code is None:
        status, detail = "TIMEOUT", f"killed after {limit:.0f} s (process group); output tail: {out[-300:]}"
    elif line is None:
        status, detail = "FAIL", f"exit {code}; output tail: {out[-800:]}"
    else:
        result = json.loads(line[len(RESULT) :])
        status = {True: "PASS", False: "FAIL", None: "SKIP"}[result["ok"]]
        detail = result["detail"]
    return {
        "check": check.name,
        "status": status,
        "detail": detail,
        "seconds": round(time.monotonic() - start, 1),
    }


def render(rows: list[dict], device: str) -> str:
    lines = [f"GPU check ({device})", "", "| check | result | seconds | detail |", "|---|---|---|---|"]
    tables = []
    for row in rows:
        detail = row["detail"]
        if "\n" in detail:  # a check's own table goes below
            tables.append(f"{row['check']}:\n\n{detail}\n")
            detail = "table below"
        lines.append(f"| {row['check']} | {row['status']} | {row['seconds']} | {detail.replace('|', '/')} |")
    return "\n".join([*lines, "", *tables]) + "\n"


def ordered(checks: Sequence[Check]) -> list[Check]:
    """Correctness checks first, benchmarks last, each in registry order."""
    return [c for c in checks if not c.benchmark] + [c for c in checks if c.benchmark]


def main(checks: Sequence[Check], helpers: dict[str, Callable[..., None]], doc: str, argv=None) -> int:
    names = [c.name for c in checks]
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out",
        type=Path,
        help="the markdown table, rewritten after every check (default on cuda: benchmarks/gpu_check.md)",
    )
    p.add_argument("--only", default=",".join(names), help=f"comma list of {names}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the logic without a GPU")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole run (default: 9 minutes)")
    p.add_argument("--logs", type=Path, help="a folder for each check's whole output, NAME.log")
    p.add_argument("--check", help=argparse.SUPPRESS)
    p.add_argument("--arg", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.check in helpers:  # a process a check starts (a rank, a notebook parent)
        helpers[args.check](args.device, *args.arg)
        return 0
    if args.check:
        check_result(next(c for c in checks if c.name == args.check), args.device)
        return 0

    wanted = args.only.split(",")
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        p.error(f"unknown check(s) {unknown}; accepted: {names}")
    import torch  # is_available() does not initialise CUDA

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: SKIPPED, CUDA is not available on this machine (nothing was checked). Run it where a "
            "GPU is, or pass --device cpu to exercise the logic on CPU."
        )
        return 0
    _terminate_as_exit()
    out = args.out or (ROOT / "benchmarks" / "gpu_check.md" if args.device == "cuda" else None)
    if out:
        print(f"gpu_check: the table is {out}, rewritten after every check", flush=True)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    started = time.monotonic()
    for check in ordered([c for c in checks if c.name in wanted]):
        left = args.budget - (time.monotonic() - started)
        if args.device == "cpu" and not check.cpu:
            row = {"check": check.name, "status": "SKIP", "detail": "no CPU form", "seconds": 0}
        elif left < MIN_START_S:
            row = {"check": check.name, "status": "SKIP", "detail": f"the {args.budget:.0f} s budget is spent",
                   "seconds": 0}  # fmt: skip
        else:
            # A shared CPU starts processes and fits more slowly than a GPU host: twice the limit there.
            limit = check.budget_s * (2 if args.device == "cpu" else 1)
            log = args.logs / f"{check.name}.log" if args.logs else None
            row = run_check(check, args.device, min(limit, left), log)
        rows.append(row)
        print(f"{check.name}: {row['status']} ({row['seconds']} s)", flush=True)
        if out:  # after every check: a run killed later still reports what it found
            out.write_text(render(rows, args.device))
    print("\n" + render(rows, args.device))
    unverified = [r for r in rows if r["status"] in ("FAIL", "TIMEOUT") or "budget is spent" in r["detail"]]
    return 1 if unverified else 0
