"""What the checks share: a one-device SoloDDP fit, small data, a one-rank process group, a helper process."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.gpu_checks.harness import ROOT, SCRIPT, child_env, run_group
from lightning_solo import SoloDDP
from lightning_solo.testing import free_port


def accelerator(device: str) -> str:
    return "gpu" if device == "cuda" else "cpu"


def now(device: str) -> float:
    """A clock reading after the device's queued work has run."""
    import time

    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def trainer(device: str, steps: int, callbacks=(), strategy=None, **kwargs) -> L.Trainer:
    """``Trainer(devices=1)`` for ``steps`` optimizer steps, quiet; ``strategy`` defaults to ``SoloDDP()``."""
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(
        accelerator=accelerator(device),
        devices=1,
        strategy=strategy or SoloDDP(),
        max_steps=steps,
        callbacks=list(callbacks),
        **{**options, **kwargs},
    )


def fit_solo(device: str, module, loader, steps: int, callbacks=(), **solo) -> L.Trainer:
    """One ``Trainer(strategy=SoloDDP(**solo), devices=1)`` fit of ``steps`` optimizer steps; the trainer."""
    fitted = trainer(device, steps, callbacks, SoloDDP(**solo))
    fitted.fit(module, loader)
    return fitted


def regression_loader(n: int = 64, width: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)), batch_size=8
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@contextmanager
def one_rank_group(device: str):
    """A world of one: nccl on CUDA (the backend a GPU run uses), gloo on CPU."""
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0) if device == "cuda" else None,
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def run_helper(name: str, device: str, *args: str, limit: float = 240, env=None) -> tuple[int | None, str]:
    """``gpu_check.py --check NAME`` (a helper: a rank, a notebook parent) as a process of its own."""
    cmd = [sys.executable, str(SCRIPT), "--check", name, "--device", device]
    for arg in args:
        cmd += ["--arg", str(arg)]
    return run_group(cmd, limit, env, new_session=False)


def join_as_rank(rank: str, port: str) -> None:
    """This process as ``rank`` of 2 on one node's device 0, as torchrun/SLURM start ranks (both on the one GPU)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=rank, NODE_RANK=rank,
                      LOCAL_RANK="0")  # fmt: skip


def two_ranks(helper: str, fn, device: str, *args: str) -> str | None:
    """``fn(device, rank, port, *args)`` as ranks 0 and 1: fresh interpreters on a GPU (``gpu_check.py --check
    helper``, as torchrun starts them), forked from this check's process on CPU (which has run no torch op: no two
    interpreter start-ups). ``None`` when both exit 0, else what failed; the check's own limit kills the group."""
    port = str(free_port())
    if device == "cpu":
        ctx = multiprocessing.get_context("fork")
        forked = [ctx.Process(target=fn, args=(device, str(r), port, *args)) for r in (0, 1)]
        for rank in forked:
            rank.start()
        for rank in forked:
            rank.join()
        codes = [rank.exitcode for rank in forked]
        return f"a rank failed: exit codes {codes}" if any(codes) else None
    cmd = [sys.executable, str(SCRIPT), "--check", helper, "--device", device]
    with tempfile.TemporaryDirectory() as tmp:  # files, not pipes: a rank blocked on a full pipe would stall both
        logs = [Path(tmp) / f"rank{r}.log" for r in (0, 1)]
        procs = []
        for r, log in enumerate(logs):
            with log.open("w") as out:
                procs.append(subprocess.Popen([*cmd, *(x for a in (str(r), port, *args) for x in ("--arg", a))],
                                              cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
        codes = [p.wait() for p in procs]
        texts = [log.read_text(errors="replace") for log in logs]
    for r, text in enumerate(texts):  # into the check's log
        print(f"--- rank {r} ---\n{text}", flush=True)
    return "a rank failed: " + " | ".join(text[-600:] for text in texts) if any(codes) else None


def runner_callbacks(out: Path, batch: int) -> list:
    """The runner's default callbacks, built from its composed config as ``python -m lightning_solo.run`` does
    (the checkpoint monitors nothing here: no validation; WarmupScaledLR is told the per-device batch), and
    RunSummary, which the runner adds."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from lightning_solo.app.run import instantiate_group
    from lightning_solo.app.run_summary import RunSummary

    overrides = [
        "callbacks.checkpoint.monitor=null",
        "callbacks.checkpoint.save_top_k=1",
        f"callbacks.warmup_scaled_lr.per_device_batch_size={batch}",
        f"hydra.runtime.output_dir={out}",
    ]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
            HydraConfig().set_config(cfg)
            return [*instantiate_group(cfg.callbacks), RunSummary()]
    finally:
        GlobalHydra.instance().clear()


#: CUDA runtime calls that block the host until the device catches up.
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"})


def device_syncs(prof) -> tuple[int, int, int]:
    """(synchronisations, device-to-host copies, value reads) in a finished ``torch.profiler.profile``: the CUDA
    runtime's stream/event/device synchronize calls, the ``Memcpy DtoH`` copies ((0, 0) on CPU by construction), and
    the reads of a tensor's value into Python (``aten::_local_scalar_dense``: ``.item()``, ``bool()``; any device)."""
    names = [e.name for e in prof.events()]
    syncs = sum(n.startswith(call) for n in names for call in SYNC_CALLS)  # a versioned name too: ..._v3020
    return syncs, sum(n.startswith("Memcpy DtoH") for n in names), names.count("aten::_local_scalar_dense")
