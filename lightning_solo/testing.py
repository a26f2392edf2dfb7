"""Run a function on N real ranks of a gloo group on this machine: for tests, benchmarks and notebooks.

Example::

    from lightning_solo.testing import run_ranks

    def work(rank, world_size, scale):
        t = torch.ones(1) * rank * scale
        torch.distributed.all_reduce(t)
        return t.item()

    run_ranks(work, 2, 10.0)   # [10.0, 10.0]

``run_ranks(fn, world_size, *args)`` forks ``world_size`` processes, joins them into a gloo process group,
calls ``fn(rank, world_size, *args)`` in each and returns the list of their results (index = rank).
A rank that raises makes the whole call raise with that rank's traceback; a rank that hangs makes it
raise after ``timeout`` seconds. Training through Lightning uses ``SoloDDP(start_method="fork")`` instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_solo._compat.torch import DispatchMode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        # Plain pickle, not torch's shared-memory reduction: a tensor must outlive the rank that made it.
        result = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 120) -> list[Any]:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


class HostSyncRecorder(DispatchMode):
    """Within ``with HostSyncRecorder() as rec:``, records each all-reduce's ``(dtype, numel)`` in
    ``rec.allreduces`` and every host sync in ``rec.syncs``: ``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``
    all go through ``_local_scalar_dense``, boolean-mask indexing through ``nonzero``. Works on any device."""

    def __init__(self) -> None:
        super().__init__()
        self.allreduces: list[tuple[str, int]] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("c10d::allreduce"):
            self.allreduces += [(str(t.dtype), t.numel()) for t in args[0]]
        elif name.split("::")[-1].split(".")[0] in ("_local_scalar_dense", "nonzero", "masked_select"):
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))
