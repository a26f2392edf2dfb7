"""Two (or more) "nodes" on this machine: one ``torchrun`` agent per node, each with its own node rank, meeting on
loopback through a static rendezvous (or c10d, for elastic restarts), every process group killed on the way out."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_solo.testing import free_port
from tests.helpers import REPO


@dataclass
class Node:
    rank: int
    returncode: int | None
    output: str


def torchrun_nodes(
    command: list[str],
    cwd: Path,
    timeout: float,
    nnodes: int = 2,
    nproc_per_node: int = 1,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
) -> list[Node]:
    """Run ``torchrun ... <command>`` as ``nnodes`` agents (``command`` starts with ``-m module`` or a script) and
    return each node's exit status and output (stdout and stderr). A node still running at ``timeout`` is
    killed with its workers, and its ``returncode`` is ``None``."""
    port = free_port()
    base_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    base_env.update(HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        base_env.pop(var, None)
    if max_restarts:
        # c10d, each attempt's process group on a store of its own (docs/multi-node.md, pytorch#135712)
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic"]
        base_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        rdzv = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    procs, logs = [], []
    for node in range(nnodes):
        log = open(cwd / f"node{node}.log", "w+")  # noqa: SIM115 - closed below
        args = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes), "--node-rank", str(node), "--nproc-per-node", str(nproc_per_node),
            *rdzv, "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
            *command,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(args, cwd=cwd, env=base_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        logs.append(log)
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        statuses = [proc.poll() for proc in procs]
        for proc in procs:
            _kill_group(proc)  # the workers of a node that failed or hangs; nothing when it ended well
    nodes = []
    for node, (status, log) in enumerate(zip(statuses, logs)):
        log.seek(0)
        nodes.append(Node(node, status, log.read()))
        log.close()
    return nodes


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
