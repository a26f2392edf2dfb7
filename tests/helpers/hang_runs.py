"""The fault suite's runs of tests/scripts/hang_fit.py (tests/test_watchdog.py, the hung ones and the
healthy ones): each 2-process run in its own directory and session, waited for
together, each with its own end's time. :func:`fault_runs` starts them all once per test process: the hung runs
first, then, once each has stalled (its processes mostly sleep), the healthy pairs, so the suite takes about the
time of its longest run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lightning_solo.testing import free_port
from tests.helpers import REPO

SCRIPT = REPO / "tests" / "scripts" / "hang_fit.py"
TIMEOUT_S = 45.0  # SoloDDP(timeout=...) where a busy rank holds the run up (it bounds the rendezvous too)
PROOF = ("extra", "kill", "uneven")  # ended on proof, at the default collective timeout
HUNG = ("sleep", "slow_exit", "loader", "checkpoint", "extra", "kill", "uneven")


def start(out, mode: str, timeout_s: float | None = None, env: dict | None = None) -> list[subprocess.Popen]:
    # Into a file: the run must end by itself, not when the last process holding a pipe open does. In a session
    # of its own, so that what the run leaves behind (stock's sleeping rank 1) goes with it. Stock's 8 s timeout
    # also bounds its rendezvous, which a rank 1 started by the popen launcher (a fresh interpreter importing
    # Lightning on a loaded machine) can miss: its ranks start together, as under torchrun.
    cmd = [sys.executable, str(SCRIPT), mode, str(out)] + ([str(timeout_s)] if timeout_s else [])
    # The popen launcher starts rank 1; the store's port from below the ephemeral range (see free_port).
    envs = [{**os.environ, **(env or {}), "MASTER_PORT": str(free_port())}]
    if mode == "stock":
        external = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": "2",
            "NODE_RANK": "0",
        }
        envs = [{**os.environ, **external, "LOCAL_RANK": str(rank)} for rank in (0, 1)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "output.txt", "w") as log:
        return [subprocess.Popen(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True) for env in envs]  # fmt: skip


def finish_all(runs: dict, limit_s: float = 150) -> dict[str, tuple[subprocess.CompletedProcess, float, dict]]:
    """``runs``: name -> (its dir, its processes), waited for together; each result's time is its own end's."""
    ended: dict[str, float] = {}
    deadline = time.monotonic() + limit_s
    late = ""
    try:
        while len(ended) < len(runs) and time.monotonic() < deadline:
            for name, (_, procs) in runs.items():
                if name not in ended and procs[0].poll() is not None:
                    ended[name] = time.time()
            time.sleep(0.1)
        late = _stacks({name: run for name, run in runs.items() if name not in ended})
    finally:
        for _, procs in runs.values():
            for each in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(each.pid, signal.SIGKILL)
                each.wait()
    assert len(ended) == len(runs), f"still running after {limit_s} s: {set(runs) - set(ended)}\n{late}"
    return {name: _result(out, procs[0].returncode, ended[name]) for name, (out, procs) in runs.items()}


def _stacks(late: dict) -> str:
    """What each run still running printed last, after its processes dumped their stacks (SIGQUIT: hang_fit.py's
    faulthandler)."""
    for _, procs in late.values():
        for pid in _group(procs[0].pid):  # one at a time: they share the run's output file
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGQUIT)
            time.sleep(0.5)
    return "\n".join(f"--- {name} ---\n{(out / 'output.txt').read_text()[-6000:]}" for name, (out, _) in late.items())


def _group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (Linux's /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                pids.append(int(stat.parent.name))
    return sorted(pids)


def finish(out, procs: list[subprocess.Popen], limit_s: float = 150) -> tuple[subprocess.CompletedProcess, float, dict]:
    return finish_all({"run": (out, procs)}, limit_s)["run"]


def _result(out, code: int, ended: float) -> tuple[subprocess.CompletedProcess, float, dict]:
    proc = subprocess.CompletedProcess([], code, (out / "output.txt").read_text(), "")
    stall = json.loads((out / "stall.json").read_text()) if (out / "stall.json").exists() else {}
    return proc, ended - stall.get("t", ended), stall


def run(out, mode: str, timeout_s: float | None = None) -> tuple[subprocess.CompletedProcess, float, dict]:
    return finish(out, start(out, mode, timeout_s))


HEALTHY = {"stock": "healthy_stock", "solo": "healthy"}
_RUNS: dict = {}


def fault_runs(base: Path) -> dict[str, tuple[Path, tuple[subprocess.CompletedProcess, float, dict]]]:
    """Every hung run (``HUNG``) and the healthy pair (``HEALTHY``'s names), once per process: name -> (its
    directory, its result)."""
    if not _RUNS:
        runs = {mode: (base / mode, start(base / mode, mode, TIMEOUT_S if mode not in PROOF else None))
                for mode in HUNG}  # fmt: skip
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not all(
            (out / "stall.json").exists() or procs[0].poll() is not None for out, procs in runs.values()
        ):
            time.sleep(0.2)
        runs.update({name: (base / name, start(base / name, mode)) for name, mode in HEALTHY.items()})
        results = finish_all(runs, 240)
        _RUNS.update({name: (out, results[name]) for name, (out, _) in runs.items()})
    return _RUNS
