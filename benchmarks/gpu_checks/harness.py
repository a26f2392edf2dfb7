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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
RESULT = "RESULT "
MIN_START_S = 15  # less left than this: a process start and a fit do not fit, the check is skipped


@dataclass(frozen=True)
class Check:
    """One row of the table: ``run(device)`` in a child process for at most ``budget_s`` seconds.

    ``cpu=False``: no CPU form (SKIP under ``--device cpu``). ``fresh=True``: a fresh interpreter on CPU too (a
    check about the process it runs in)."""

    name: str
    run: Callable[[str], tuple[bool | None, str]]
    budget_s: float = 0
    cpu: bool = True
    fresh: bool = False


@dataclass(frozen=True)
class Bundle:
    """Small single-process checks run one after another in one child process (one interpreter start, one
    ``budget_s`` for them all), one row each; a check that raises is a FAIL row and the next one runs."""

    name: str
    checks: tuple[Check, ...]
    budget_s: float
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


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """Meanwhile SIGTERM/SIGHUP (an outer timeout, a closed terminal) raise SystemExit here, so that run_group's
    ``finally`` kills the running check's group: it is in a session of its own and would outlive this process
    otherwise. The handlers before are put back after."""
    previous = {sig: signal.signal(sig, lambda signum, frame: sys.exit(128 + signum)) for sig in _TERMINATE}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_TERMINATE = (signal.SIGTERM, signal.SIGHUP)


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


def check_results(checks: Sequence[Check], device: str) -> None:
    """Run ``checks`` here, one after another, each printing its RESULT line (the child's side of
    :func:`run_check`); in a bundle, one that raises is reported and the next one runs."""
    import gc

    for check in checks:
        start = time.monotonic()
        try:
            ok, detail = check.run(device)
        except Exception:  # noqa: BLE001 - one row's failure, with its traceback in the log
            traceback.print_exc()
            ok, detail = False, "raised: " + traceback.format_exc(limit=-3)[-600:]
        try:
            _fresh_state(device)
        except Exception:  # noqa: BLE001 - the device is in an error state: this row fails, the next ones say more
            traceback.print_exc()
            ok, detail = False, f"{detail}; then the cleanup after it raised: {traceback.format_exc(limit=-1)[-300:]}"
        took = round(time.monotonic() - start, 1)
        result = {"check": check.name, "ok": None if ok is None else bool(ok), "detail": detail, "seconds": took}
        print(RESULT + json.dumps(result), flush=True)
        gc.collect()


def _fresh_state(device: str) -> None:
    """What a fresh interpreter would give the next check of a bundle: no process group, the device's cache empty."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_check(
    entry: Check | Bundle, device: str, limit: float, log: Path | None = None, checks: Sequence[Check] | None = None
) -> list[dict]:
    """One check or bundle (``checks``: those of its checks, default all) in a fresh interpreter (forked from this
    one on CPU); a row {check, status, detail, seconds} per check. ``log``: the whole output is written there."""
    start = time.monotonic()
    checks = checks or rows_of([entry])
    names = ",".join(c.name for c in checks)
    if device == "cpu" and not entry.fresh:
        code, out = run_forked(lambda: check_results(checks, device), limit)
    else:
        cmd = [sys.executable, str(SCRIPT), "--check", entry.name, "--only", names, "--device", device]
        code, out = run_group(cmd, limit)
    if log is not None:
        log.write_text(out)
    results = {}
    for line in out.splitlines():
        with contextlib.suppress(ValueError):  # a line another process's output broke into is no result
            if line.startswith(RESULT):
                result = json.loads(line[len(RESULT) :])
                results[result["check"]] = result
    tail = out[-800:].replace("\n", " ⏎ ")
    rows = []
    for check in checks:
        if check.name in results:
            result = results[check.name]
            status = {True: "PASS", False: "FAIL", None: "SKIP"}[result["ok"]]
            rows.append({"check": check.name, "status": status, "detail": result["detail"],
                         "seconds": result["seconds"]})  # fmt: skip
        elif code is None:
            detail = f"killed after {limit:.0f} s (process group); output tail: {tail[-300:]}"
            rows.append({"check": check.name, "status": "TIMEOUT", "detail": detail, "seconds": None})
        else:
            rows.append({"check": check.name, "status": "FAIL", "detail": f"exit {code}; output tail: {tail}",
                         "seconds": None})  # fmt: skip
    # The time no result accounts for (start-up, the check that did not finish) goes to the first unfinished row.
    left = time.monotonic() - start - sum(r["seconds"] or 0 for r in rows)
    target = next((r for r in rows if r["seconds"] is None), rows[0])
    for row in rows:
        row["seconds"] = round((row["seconds"] or 0) + (left if row is target else 0), 1)
    return rows


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


def rows_of(entries: Sequence[Check | Bundle]) -> list[Check]:
    """Every check, one per row, in the order they run."""
    return [c for e in entries for c in (e.checks if isinstance(e, Bundle) else (e,))]


def main(entries: Sequence[Check | Bundle], helpers: dict[str, Callable[..., None]], doc: str, argv=None) -> int:
    checks = rows_of(entries)
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
    wanted = args.only.split(",")
    if args.check:  # a check or bundle, in the process run_check started
        entry = next(e for e in entries if e.name == args.check)
        check_results([c for c in rows_of([entry]) if c.name in wanted], args.device)
        return 0

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
    with _terminate_as_exit():
        out = args.out or (ROOT / "benchmarks" / "gpu_check.md" if args.device == "cuda" else None)
        if out:
            print(f"gpu_check: the table is {out}, rewritten after every check", flush=True)
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
        rows: list[dict] = []
        started = time.monotonic()
        for entry in entries:
            inner = [c for c in rows_of([entry]) if c.name in wanted]
            runnable = [c for c in inner if args.device == "cuda" or c.cpu]
            skipped = {c.name: "no CPU form" for c in inner if c not in runnable}
            left = args.budget - (time.monotonic() - started)
            if runnable and left < MIN_START_S:
                skipped.update({c.name: f"the {args.budget:.0f} s budget is spent" for c in runnable})
            ran = {}
            if runnable and left >= MIN_START_S:
                # A shared CPU starts processes and fits more slowly than a GPU host: three times the limit there.
                limit = entry.budget_s * (3 if args.device == "cpu" else 1)
                log = args.logs / f"{entry.name}.log" if args.logs else None
                ran = {row["check"]: row for row in run_check(entry, args.device, min(limit, left), log, runnable)}
            rows_now = [ran.get(c.name) or {"check": c.name, "status": "SKIP", "detail": skipped[c.name], "seconds": 0}
                        for c in inner]  # fmt: skip
            for row in rows_now:
                rows.append(row)
                print(f"{row['check']}: {row['status']} ({row['seconds']} s)", flush=True)
            if out and rows_now:  # after every check: a run killed later still reports what it found
                out.write_text(render(rows, args.device))
        print("\n" + render(rows, args.device))
        unverified = [r for r in rows if r["status"] in ("FAIL", "TIMEOUT") or "budget is spent" in r["detail"]]
        return 1 if unverified else 0
