"""Runs the corpus in one long-lived pair of gloo ranks: each pattern under stock ``DDPStrategy``, then (when the
pattern turns a documented default off) ``SoloDDP(**pattern.solo)``, then ``SoloDDP()``.

The ranks join a process group made before Lightning starts (``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set, as
under torchrun), so each fit costs a Trainer, not two new processes. A fit that fails may leave the ranks out
of step in their collectives: the rank reports and exits, and the parent starts a fresh pair for the patterns
left. A pattern that hangs is ended after its timeout the same way.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue as queues
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

WORLD_SIZE = 2
GRACE_S = 5  # how long to wait for the other rank's report once one rank failed
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


class Trainers:
    """``trainer(**kwargs)``: a ``Trainer`` on 2 CPU devices with a fresh strategy; ``trainer.root``: a directory
    the ranks share."""

    def __init__(self, make_strategy, root: str, devices: int = WORLD_SIZE) -> None:
        self.make_strategy, self.root, self.devices = make_strategy, root, devices

    def __call__(self, **kwargs: Any):
        import lightning as L

        defaults = dict(accelerator="cpu", devices=self.devices, strategy=self.make_strategy(), max_epochs=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=self.root)  # fmt: skip
        return L.Trainer(**{**defaults, **kwargs})


def variants(pattern) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_solo import SoloDDP

    runs = {"stock": lambda: DDPStrategy(**pattern.stock)}
    if pattern.solo:
        runs["solo_off"] = lambda: SoloDDP(**pattern.solo)
    runs["solo"] = SoloDDP
    if pattern.also:
        runs["solo_also"] = lambda: SoloDDP(**pattern.also)
    return runs


def where(err: BaseException) -> str:
    """The frame the error came from: the innermost one in lightning_solo if any, else the innermost."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = [f for f in frames if "lightning_solo" in f.filename] or frames
    f = ours[-1]
    return f"{f.filename.split('site-packages/')[-1].removeprefix(REPO)}:{f.lineno} in {f.name}"


def fit_once(pattern, make_strategy, root: str, devices: int = WORLD_SIZE) -> dict[str, Any]:
    import lightning as L
    import torch

    os.makedirs(root, exist_ok=True)
    L.seed_everything(0, verbose=False)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = pattern.run(Trainers(make_strategy, root, devices))
    except Exception as err:  # noqa: BLE001 - the outcome is the result
        lines = [line for line in str(err).strip().splitlines() if line.strip()] or [""]
        first = (lines[-1] if lines[0].endswith(":") else lines[0])[:300]  # a child's traceback: its error
        error, tb = f"{type(err).__name__}: {first}", traceback.format_exc()
        return {"error": error, "where": where(err), "tb": tb, "seconds": time.perf_counter() - start}
    model, extras = out if isinstance(out, tuple) else (out, None)
    weights = {k: v.detach().clone().cpu() for k, v in model.state_dict().items() if torch.is_floating_point(v)}
    return {"error": None, "weights": weights, "extras": extras, "seconds": time.perf_counter() - start}


def _rank(rank: int, world_size: int, port: int, names: list[str], root: str, queue) -> None:
    import torch
    import torch.distributed as dist

    from tests.conformance.patterns import PATTERNS

    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    if world_size > 1:  # ranks already running, as under torchrun; devices=1 starts as a plain script does
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world_size))  # fmt: skip
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    for name in names:
        result = {}
        for variant, make in variants(PATTERNS[name]).items():
            result[variant] = fit_once(PATTERNS[name], make, os.path.join(root, name, variant), world_size)
            if result[variant]["error"]:
                break
        queue.put((name, rank, pickle.dumps(result)))
        if any(r["error"] for r in result.values()):
            break  # the ranks may be out of step: the parent starts a fresh pair
    queue.put((None, rank, None))
    if dist.is_initialized():
        dist.destroy_process_group()


def _collect(queue, got: dict, name: str, world_size: int, timeout: float) -> list[dict[str, Any]]:
    """Every rank's report on ``name``, or a "hang" entry for a rank that did not report in time."""
    deadline = time.monotonic() + timeout
    while (reports := sum((name, r) in got for r in range(world_size))) < world_size:
        try:
            n, rank, payload = queue.get(timeout=max(0.1, deadline - time.monotonic()))
        except queues.Empty:
            break
        if n is not None:
            got[(n, rank)] = pickle.loads(payload)
            if any(v["error"] for v in got[(n, rank)].values()):
                deadline = min(deadline, time.monotonic() + GRACE_S)
    late = f"{GRACE_S} s after another rank failed" if reports else f"in {timeout} s"
    hang = {"hang": {"error": f"timeout: no report {late}", "where": "the ranks were ended"}}
    return [got.get((name, r), hang) for r in range(world_size)]


def run_corpus(names: list[str], root: str, world_size: int = WORLD_SIZE) -> dict[str, list[dict[str, Any]]]:
    """``{name: [each rank's result]}``; a result maps each variant to its outcome."""
    from lightning_solo.testing import free_port
    from tests.conformance.patterns import PATTERNS

    ctx = mp.get_context("fork")
    results: dict[str, list[dict[str, Any]]] = {}
    pending = list(names)
    while pending:  # one pair of ranks, until a pattern fails
        queue, got = ctx.Queue(), {}
        args = (world_size, free_port(), pending, root, queue)
        procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world_size)]  # not daemons: workers
        for p in procs:
            p.start()
        try:
            while pending:
                name = pending.pop(0)
                results[name] = _collect(queue, got, name, world_size, PATTERNS[name].timeout)
                if any(v["error"] for r in results[name] for v in r.values()):
                    break
        finally:
            for p in procs:
                p.kill()
                p.join(timeout=5)
            queue.close()
    return results
