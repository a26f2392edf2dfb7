"""What the checks share: a one-device SoloDDP fit, small data, a one-rank process group, a helper process."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.gpu_checks.harness import SCRIPT, run_group
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
