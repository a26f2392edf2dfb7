"""One rank of one measurement of ``benchmarks/compare.py``: build the workload, train one contender, print a result.

Started by ``compare.py`` as ``python -m benchmarks.compare_worker '<spec json>'`` with ``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` set, the way torchrun starts ranks, so that every
contender (the raw loops and both Lightning strategies) runs in fresh processes started the same way, and a
rank's peak RSS belongs to that contender alone. Prints one line ``RESULT {json}``.

Contenders (``spec["kind"]``): ``raw`` (a hand-written DDP loop), ``ceiling`` (the same loop without DDP: no
communication at all; either with ``cpu_malloc_reuse``: SoloDDP's malloc setting), ``stock`` (``Trainer(strategy="ddp")``), ``solo`` (``Trainer(strategy=SoloDDP(**solo))``,
optionally with ``ablate`` switching one of its per-step pieces off, or ``profile`` timing them).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from typing import Any

# Every contender imports the same (so the RSS baselines match), lightning_solo first: Lightning then loads with the
# GC paused (lightning_solo/__init__.py) in every contender alike.
import lightning_solo  # noqa: F401

# isort: split
import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_solo.app.models import build_backbone

RESULT = "RESULT "


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


# ------------------------------------------------------------------ workloads


def build_workload(spec: dict, world: int | None = None) -> tuple[nn.Module, TensorDataset, TensorDataset | None]:
    """The network (same initial weights on every rank) and the training (and held-out) data, for ``world``
    ranks (default: ``WORLD_SIZE``)."""
    world, batch = world or int(os.environ["WORLD_SIZE"]), spec["batch"]
    n = world * batch * spec["batches"]  # exactly the batches the run takes: one epoch
    gen = torch.Generator().manual_seed(1234)
    held_out = None
    torch.manual_seed(0)
    if spec["workload"] == "resnet18":
        net = build_backbone("resnet18", 10, stem="cifar")
        data = TensorDataset(torch.randn(n, 3, 32, 32, generator=gen), torch.randint(10, (n,), generator=gen))
    elif spec["workload"] == "mlp":
        width, layers = spec["width"], spec["layers"]
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        net = nn.Sequential(*blocks, nn.Linear(width, 10))
        # Ten classes, each a random direction plus unit noise: learnable in a few hundred small steps, not at once.
        means = torch.randn(10, width, generator=gen)
        y = torch.randint(10, (n + 512,), generator=gen)
        x = 0.1 * means[y] + torch.randn(n + 512, width, generator=gen)
        data, held_out = TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])
    elif spec["workload"] == "digits":
        from lightning_solo.app.data import DigitsDataModule

        dm = DigitsDataModule()
        dm.setup("fit")
        net = build_backbone("small_cnn", 10, in_channels=1)
        x, y = dm.train_set.tensors
        reps = -(-n // len(y))
        data = TensorDataset(x.repeat(reps, 1, 1, 1)[:n], y.repeat(reps)[:n])
        held_out = dm.val_set
    else:
        raise ValueError(f"unknown workload {spec['workload']!r}")
    return net, data, held_out


def make_optimizer(params, spec: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=spec["lr"], momentum=0.9)


@torch.no_grad()
def held_out_loss(net: nn.Module, held_out: TensorDataset | None) -> float | None:
    if held_out is None:
        return None
    net.eval()
    x, y = held_out.tensors
    return F.cross_entropy(net(x), y).item()


class Window:
    """Wall and CPU time from the start of batch ``warmup`` to the end of the last batch (batches, not steps).

    CPU time (``time.process_time``: every thread of this process) counts the work a contender does and not the
    time it waits, for the other rank or for a core another job holds, so it is far steadier on a shared machine.
    Minor page faults count the pages the allocator took fresh from the kernel (a first touch each).
    """

    def __init__(self, warmup: int, batches: int) -> None:
        self.warmup, self.last = warmup, batches - 1
        self.start = self.end = self.cpu_start = self.cpu_end = None
        self.faults_start = self.faults_end = 0

    def batch_start(self, i: int) -> None:
        if i == self.warmup:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
            self.faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def batch_end(self, i: int) -> None:
        if i == self.last:
            self.end, self.cpu_end = time.perf_counter(), time.process_time()
            self.faults_end = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def cpu_seconds(self) -> float:
        return self.cpu_end - self.cpu_start


# ------------------------------------------------------------------ the raw loops


def run_raw(spec: dict, net: nn.Module, data: TensorDataset, window: Window) -> nn.Module:
    if spec.get("cpu_malloc_reuse"):  # the same allocator setting as SoloDDP's, for a like-for-like bound
        from lightning_solo.core import cpu_malloc

        cpu_malloc.decide(reuse=True)
    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(net) if spec["kind"] == "raw" else net
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=spec["batch"], sampler=sampler)
    optimizer = make_optimizer(model.parameters(), spec)
    dist.barrier()
    for i, (x, y) in enumerate(loader):
        window.batch_start(i)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        window.batch_end(i)
    dist.barrier()
    dist.destroy_process_group()
    return net


# ------------------------------------------------------------------ Lightning contenders


class Module(L.LightningModule):
    def __init__(self, net: nn.Module, data: TensorDataset, spec: dict, window: Window) -> None:
        super().__init__()
        self.net, self.data, self.spec, self.window = net, data, spec, window

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.spec["batch"], shuffle=True)

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.spec)

    def on_train_batch_start(self, batch, batch_idx):
        self.window.batch_start(batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.window.batch_end(batch_idx)


def replace_everywhere(original: Any, replacement: Any) -> None:
    """Point every ``lightning_solo`` module's name for ``original`` at ``replacement`` (wherever a refactor
    moved the caller, it finds the replacement)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_solo") and module is not None:
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attr, replacement)


def ablate(what: str) -> None:
    """Switch one of SoloDDP's per-step pieces off, for this benchmark process only."""
    from lightning_solo.core.decision import Decision
    from lightning_solo.ddp import comm
    from lightning_solo.ddp.resume import loader as resumable_loader
    from lightning_solo.ddp.resume import record as resume

    if what == "no_resumable_loader":  # no ResumableSampler / SeededDataset around the training loader
        replace_everywhere(
            resumable_loader.make_resumable,
            lambda loader, seed: (loader, Decision("resumable_data", False, "ablated")),
        )
    elif what == "no_sample_seeding":  # ResumableSampler kept; samples loaded without per-sample RNG seeding
        resumable_loader.SeededDataset.__getitems__ = lambda self, keys: [self.dataset[k[1]] for k in keys]
    elif what == "no_rng_capture":  # no RNG state / buffer snapshot after every optimizer step
        replace_everywhere(resume.rng_state, lambda: None)
        replace_everywhere(resume.step_buffers, lambda trainer: None)
    elif what in ("lightning_sigterm_check", "no_sigterm_check"):
        # Lightning's per-batch broadcast instead of SoloDDP's agreement; or no check at all (the bound for any).
        from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

        from lightning_solo.ddp.sigterm import SigtermAgreement

        SigtermAgreement.install = lambda self, trainer: Decision("sigterm_check", "lightning", "ablated")
        if what == "no_sigterm_check":
            _TrainingEpochLoop._broadcast_sigterm_tensor = lambda self: None
    elif what == "plain_barrier":
        replace_everywhere(comm.monitored_barrier, lambda name, timeout, group: dist.barrier())
    else:
        raise ValueError(f"unknown ablation {what!r}")


def profile_pieces() -> dict[str, list[float]]:
    """Time SoloDDP's per-step pieces where they are called: ``{name: [seconds, calls]}``."""
    from lightning_solo.ddp.resume import loader as resumable_loader
    from lightning_solo.ddp.resume import record as resume
    from lightning_solo.ddp.unused.policy import UnusedParameters

    spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name][0] += time.perf_counter() - start
                spent[name][1] += 1

        return wrapper

    for method in ("before_backward", "after_backward", "at_boundary"):
        setattr(UnusedParameters, method, timed(f"unused.{method}", getattr(UnusedParameters, method)))
    replace_everywhere(resume.rng_state, timed("resume.rng_state", resume.rng_state))
    replace_everywhere(resume.step_buffers, timed("resume.step_buffers", resume.step_buffers))
    seeded, sampler = resumable_loader.SeededDataset, resumable_loader.ResumableSampler
    seeded.__getitems__ = timed("SeededDataset.__getitems__", seeded.__getitems__)
    sampler.__iter__ = timed("ResumableSampler.__iter__", sampler.__iter__)
    return spent


def run_lightning(spec: dict, net: nn.Module, data: TensorDataset, window: Window) -> nn.Module:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if spec["kind"] == "stock":
        strategy: Any = "ddp"
    else:
        from lightning_solo import SoloDDP  # every module loaded before ablate/profile patch them

        for what in spec.get("ablate", []):
            ablate(what)
        strategy = SoloDDP(**spec.get("solo", {}))
    accumulate = spec.get("accumulate", 1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        max_steps=spec["batches"] // accumulate,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Module(net, data, spec, window))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return net


# ------------------------------------------------------------------ entry


def main(spec: dict) -> dict:
    torch.set_num_threads(spec["threads"])
    baseline = peak_rss_mb()
    net, data, held_out = build_workload(spec)
    window = Window(spec["warmup"], spec["batches"])
    from lightning_solo import SoloDDP  # noqa: F401 - every module loaded before profile_pieces patches them

    spent = profile_pieces() if spec.get("profile") else None
    if spec["kind"] in ("raw", "ceiling"):
        net = run_raw(spec, net, data, window)
    else:
        net = run_lightning(spec, net, data, window)
    rank = int(os.environ["RANK"])
    timed = spec["batches"] - spec["warmup"]
    out = {
        "rank": rank,
        "seconds": window.seconds,
        "cpu_ms_per_batch": window.cpu_seconds / timed * 1e3,
        "page_faults_per_batch": (window.faults_end - window.faults_start) / timed,
        "samples": timed * spec["batch"],
        "peak_rss_mb": peak_rss_mb(),
        "baseline_rss_mb": baseline,
        "grad_mb": sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20,
        "loss": held_out_loss(net, held_out) if rank == 0 else None,
    }
    if spent is not None:
        out["pieces"] = {name: [seconds, calls] for name, (seconds, calls) in spent.items()}
    return out


if __name__ == "__main__":
    print(RESULT + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
