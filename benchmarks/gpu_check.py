"""One short run on one GPU that checks the CUDA paths no CPU test can (issues 16, 18), and prints one table.

Checks (each in its own subprocess, so a CUDA context never leaks into a fork), in the order they run:

* ``nccl1``: ``SoloDDP()`` on one GPU: an nccl process group of world size 1, its monitored barrier (gloo side
  group) and a CUDA all-reduce inside the fit.
* ``scaler``: ``SoloDDP(precision="16-mixed")`` on CUDA: a step whose loss is made inf overflows; the
  GradScaler skips it (weights unchanged), halves the scale and counts it.
* ``syncbn_cuda``: ``SoloDDP(sync_batchnorm=True)`` on CUDA converts BatchNorm to SoloSyncBatchNorm for the fit,
  on the device, and reverts it to the original class after.
* ``precision``: ``bench_precision.py --arch resnet50`` at 224² × 256: fp32 (strict), bf16-mixed, 16-mixed,
  with and without channels_last: images/s and peak memory, against the targets (bf16 ≥ 2× NVIDIA's A100
  AMP figure of ~2,470 images/s; AMP peak memory ≤ 0.7× fp32).
* ``solo_vs_plain``: ResNet-50 bf16 channels_last, a plain PyTorch loop against ``Trainer(strategy=SoloDDP())``
  on the one device (same batch, same steps), interleaved.
* ``rewrap``: 2 processes on the one GPU (gloo: NCCL refuses two ranks on one device) train a model whose
  branch rank 1 skips every other step from step 10, so SoloDDP's ``find_unused_parameters="auto"`` re-wraps
  DDP twice (to the fast path after its window, to ``True`` after the first skip), each time while the
  previous optimizer step may still run on the GPU; the replicas' parameters must be bit-identical.
* ``syncbn``: SoloSyncBatchNorm, 2 processes on the GPU, rank 0's batch empty, bf16 autocast: output, input
  gradient and running statistics vs BatchNorm over the joined batch; no host sync; identical collectives.
* ``rng``: ``resume.rng_state()`` / ``resume.set_rng_state()`` bring the current device's CUDA generator back.
* ``fork``: after CUDA is initialised, ``SoloDDP(start_method="fork")`` must refuse with a clear error, not
  let every worker die with "Cannot re-initialize CUDA in forked subprocess".
* ``precision``: ``bench_precision.py`` at 224² × 128, channels_last: strict fp32, TF32, bf16-mixed, 16-mixed.
* ``compile``: ``SoloDDP(compile=True)`` (inductor) on the one GPU: compiled inside DDP's forward, no fallback to
  eager, no recompile over the fit, and the weights after 6 steps within 1e-4 (relative) of the eager fit's.
* ``fsdp``: ``SoloFSDP`` on the one GPU (nccl, a one-rank mesh): ``precision="auto"`` must pick bf16 parameters
  with fp32 reduction, the sharded checkpoint must verify and consolidate into a plain model (weights_only).

The whole run keeps within ``--budget`` seconds (default 480): a check that would start after it is reported
as skipped, and each check's own limit is what is left.

Usage::

    python benchmarks/gpu_check.py --out benchmarks/gpu_check.md      # about 6 minutes on an H200
    python benchmarks/gpu_check.py --device cpu --only nccl1,scaler,syncbn_cuda,solo_vs_plain   # on CPU

Without CUDA (and no ``--device cpu``) it prints why and exits 0, having checked nothing. On CPU the checks run
at small sizes with gloo: the logic, not the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = (
    "nccl1",
    "scaler",
    "syncbn_cuda",
    "precision",
    "solo_vs_plain",
    "rewrap",
    "syncbn",
    "rng",
    "fork",
    "compile",
    "fsdp",
)
#: NVIDIA's published ResNet-50 AMP training throughput on one A100 (images/s); the target is twice it.
A100_AMP_IMAGES_PER_S = 2470
RESULT = "RESULT "


# ------------------------------------------------------------------ checks (each runs in a child process)


def _rewrap_rank(device: str, rank: int, port: int, out: str) -> None:
    """One of two ranks, started as an external process (the way torchrun/SLURM start them)."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_solo import SoloDDP

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        RANK=str(rank),
        NODE_RANK=str(rank),
        LOCAL_RANK="0",
    )

    class Branchy(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.trunk, self.branch, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = torch.relu(self.trunk(x))
            # All used in the evidence window (re-wrap to the fast path at step 4), then rank 1 skips the
            # branch every other step from step 10 (completed exactly, re-wrap to True at the next step).
            if not (self.global_rank == 1 and batch_idx >= 10 and batch_idx % 2):
                h = h + self.branch(h)
            return nn.functional.mse_loss(self.head(h), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 4, generator=g))
    model = Branchy()
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        num_nodes=2,
        max_steps=40,
        strategy=SoloDDP(start_method="popen", process_group_backend="gloo"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8))
    flat = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    decision = trainer.strategy.decisions["find_unused_parameters"]
    torch.save(
        {"params": flat, "find_unused": decision.value, "reason": decision.reason}, f"{out}/rank{rank}.pt"
    )


def check_rewrap(device: str) -> tuple[bool, str]:
    import tempfile

    import torch

    from lightning_solo.testing import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--check",
                    "rewrap-rank",
                    "--device",
                    device,
                    "--rank",
                    str(r),
                    "--port",
                    str(port),
                    "--tmp",
                    out,
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in (0, 1)
        ]
        logs = [p.communicate(timeout=240)[0] for p in procs]
        if any(p.returncode for p in procs):
            return False, "a rank failed: " + " | ".join(log[-600:] for log in logs)
        r0, r1 = (torch.load(f"{out}/rank{r}.pt", weights_only=True) for r in (0, 1))
    identical = torch.equal(r0["params"], r1["params"])
    rewrapped = all(r["find_unused"] is True and "switched" in r["reason"] for r in (r0, r1))
    diff = (r0["params"] - r1["params"]).abs().max().item()
    return identical and rewrapped, (
        f"find_unused_parameters={r0['find_unused']!r} ({r0['reason'][-90:]}); replicas bit-identical: "
        f"{identical} (max diff {diff:.3g})"
    )


def _syncbn_rank(rank: int, world_size: int, device: str) -> dict:
    import copy

    import torch
    from torch import nn

    from lightning_solo.ddp import syncbn
    from lightning_solo.testing import HostSyncRecorder

    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks on the one GPU
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Conv2d(16, 4, 1)).to(device)
    net.to(memory_format=torch.channels_last)
    mine = syncbn.convert(copy.deepcopy(net))
    x = torch.randn(8, 3, 16, 16, device=device) + 3.0
    local = x[: 0 if rank == 0 else 8].clone().requires_grad_()
    recorder = HostSyncRecorder()
    with torch.autocast(device, dtype=torch.bfloat16), recorder:
        y = mine(local)
        y.float().square().sum().backward()
    ref_x = x.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        ref_y = net(ref_x)
        ref_y.float().square().sum().backward()

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()

    out = {
        "syncs": recorder.syncs,
        "allreduces": recorder.allreduces,
        "dtype": str(y.dtype),
        "running_var": rel(mine[1].running_var, net[1].running_var),
    }
    if rank == 1:
        out.update(y=rel(y.detach(), ref_y.detach()), grad_x=rel(local.grad, ref_x.grad))
    return out


def check_syncbn(device: str) -> tuple[bool, str]:
    from lightning_solo.testing import run_ranks

    empty, full = run_ranks(_syncbn_rank, 2, device)
    ok = (
        full["syncs"] == []
        and len(empty["syncs"]) == 1  # the empty rank reads the global count (a clear error, not an assert)
        and empty["allreduces"] == full["allreduces"]
        and full["dtype"] == "torch.bfloat16"
        and max(empty["running_var"], full["running_var"]) <= 1e-4
        and full["y"] <= 2e-2
        and full["grad_x"] <= 3e-2
    )
    return ok, (
        f"rel. err y {full['y']:.2g}, grad_x {full['grad_x']:.2g}, running_var {full['running_var']:.2g}; "
        f"host syncs {len(empty['syncs']) + len(full['syncs'])}; all-reduces {full['allreduces']} on both ranks"
    )


def check_rng(device: str) -> tuple[bool, str]:
    import torch

    from lightning_solo.ddp.resume import record as resume

    if device == "cuda":
        torch.cuda.set_device(0)
        torch.randn(1, device="cuda")  # CUDA initialised: its generator is part of the state
    state = resume.rng_state()
    first = torch.randn(4, device=device), torch.randn(4)
    resume.set_rng_state(state)
    again = torch.randn(4, device=device), torch.randn(4)
    same = all(torch.equal(a, b) for a, b in zip(first, again))
    cuda = state.get("cuda")
    held = f"{len(cuda)} CUDA generator state(s)" if isinstance(cuda, (list, tuple)) else type(cuda).__name__
    return same, f"draws after restore identical: {same}; saved: {held}"


def _fork_child() -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_solo import SoloDDP

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.zeros(1, device="cuda")  # what a notebook cell does before fit
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(start_method="fork"),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    try:
        trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2))
    except Exception as err:  # noqa: BLE001 - what the user would see
        print(f"REFUSED {type(err).__name__}: {err}", flush=True)
        return
    print("NOT REFUSED", flush=True)


def check_fork(device: str) -> tuple[bool, str]:
    if device != "cuda":
        return True, "skipped: needs CUDA"
    proc = subprocess.run(
        [sys.executable, __file__, "--check", "fork-child"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    refused = next((line for line in proc.stdout.splitlines() if line.startswith("REFUSED")), None)
    ok = refused is not None and "CUDA" in refused and "Cannot re-initialize" not in out
    return ok, (refused or f"no clear refusal; output tail: {out[-400:]}")[:300]


def _accelerator(device: str) -> str:
    return "gpu" if device == "cuda" else "cpu"


def _fit_solo(device: str, module, loader, steps: int, callbacks=(), **solo) -> object:
    """One ``Trainer(strategy=SoloDDP(**solo), devices=1)`` fit of ``steps`` optimizer steps; the trainer."""
    import lightning as L

    from lightning_solo import SoloDDP

    trainer = L.Trainer(
        accelerator=_accelerator(device),
        devices=1,
        strategy=SoloDDP(**solo),
        max_steps=steps,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return trainer


def _regression_loader(n: int = 64, width: int = 8):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)), batch_size=8
    )


def check_nccl1(device: str) -> tuple[bool, str]:
    import lightning as L
    import torch
    import torch.distributed as dist

    seen: dict = {}

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_end(self):
            seen["backend"] = dist.get_backend()
            seen["world"] = dist.get_world_size()
            self.trainer.strategy.barrier("gpu_check")  # the monitored barrier, on its group
            total = torch.ones(1, device=self.device)
            dist.all_reduce(total)
            seen["all_reduce"] = total.item()

    trainer = _fit_solo(device, Probe(), _regression_loader(), steps=3)
    decisions = trainer.strategy.decisions
    want = "nccl" if device == "cuda" else "gloo"
    ok = (
        seen.get("backend") == want
        and seen.get("world") == 1
        and seen.get("all_reduce") == 1.0
        and decisions["process_group_backend"].value == want
        and trainer.global_step == 3
    )
    barrier = decisions.get("barrier")
    return ok, (
        f"backend {seen.get('backend')}, world size {seen.get('world')}, all-reduce {seen.get('all_reduce')}; "
        f"barrier = {barrier.value!r} ({barrier.reason[:80]})"
        if barrier
        else f"seen {seen}; no barrier decision"
    )


def check_compile(device: str) -> tuple[bool, str]:
    import lightning as L
    import torch

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    weights = {}
    for setting in (False, True):
        module = Probe()
        trainer = _fit_solo(device, module, _regression_loader(), steps=6, compile=setting)
        weights[setting] = torch.nn.utils.parameters_to_vector(module.parameters()).detach().cpu()
    decisions = trainer.strategy.decisions
    compiled = decisions["compile"]
    rel = float((weights[True] - weights[False]).norm() / weights[False].norm())
    ok = (
        compiled.value is True
        and "inside DDP's forward" in compiled.reason
        and "0 recompiles" in compiled.reason
        and "compile_fallback" not in decisions
        and rel <= 1e-4
    )
    fallback = decisions.get("compile_fallback")
    return ok, f"weights vs eager {rel:.1e}; {compiled.reason[-70:]}" + (
        f"; {fallback.reason[:80]}" if fallback else ""
    )


def check_scaler(device: str) -> tuple[bool, str]:
    import lightning as L
    import torch

    overflow_at = 3
    trace: list[tuple[torch.Tensor, float]] = []

    class Overflowing(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]).float(), batch[1])
            return loss * float("inf") if batch_idx == overflow_at else loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            scaler = self.trainer.precision_plugin.scaler
            trace.append(
                (torch.cat([p.detach().flatten().cpu() for p in self.parameters()]), scaler.get_scale())
            )

    trainer = _fit_solo(device, Overflowing(), _regression_loader(), steps=6, precision="16-mixed")
    plugin = trainer.precision_plugin
    params, scales = [t[0] for t in trace], [t[1] for t in trace]
    skipped_held = torch.equal(params[overflow_at], params[overflow_at - 1])
    others_moved = all(
        not torch.equal(params[i], params[i - 1]) for i in range(1, len(params)) if i != overflow_at
    )
    backed_off = scales[overflow_at] == scales[overflow_at - 1] * plugin.scaler_settings.get(
        "backoff_factor", 0.5
    )
    scaler_device = plugin.scaler._scale.device.type if plugin.scaler._scale is not None else None
    ok = (
        skipped_held and others_moved and backed_off and plugin.skipped_steps == 1 and scaler_device == device
    )
    return ok, (
        f"step {overflow_at} overflowed: weights held {skipped_held}, other steps moved {others_moved}; "
        f"scale {scales[overflow_at - 1]:g} -> {scales[overflow_at]:g}; skipped_steps {plugin.skipped_steps}; "
        f"scale on {scaler_device}"
    )


def check_syncbn_cuda(device: str) -> tuple[bool, str]:
    import lightning as L
    import torch
    from torch import nn

    during: dict = {}

    class WithBN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1),
                nn.BatchNorm2d(8),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(8, 4),
            )

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_start(self):
            bn = self.net[1]
            during.update(cls=type(bn).__name__, device=bn.running_mean.device.type)

    g = torch.Generator().manual_seed(0)
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(32, 3, 8, 8, generator=g) + 2.0, torch.randint(4, (32,), generator=g))
    module = WithBN()
    trainer = _fit_solo(device, module, DataLoader(data, batch_size=8), steps=3, sync_batchnorm=True)
    bn = module.net[1]
    decision = trainer.strategy.decisions["sync_batchnorm"]
    ok = (
        during.get("cls") == "SoloSyncBatchNorm"
        and during.get("device") == device
        and type(bn) is nn.BatchNorm2d
        and bn.running_mean.abs().sum().item() > 0
        and decision.value is True
    )
    return ok, (
        f"during fit: {during.get('cls')} on {during.get('device')}; after: {type(bn).__name__}, running_mean "
        f"moved {bn.running_mean.abs().sum().item() > 0}; decision {decision.value!r} ({decision.reason[:60]})"
    )


def _precision_sizes(device: str) -> list[str]:
    if device == "cuda":
        return [
            "--image-size",
            "224",
            "--batch-size",
            "256",
            "--warmup",
            "5",
            "--steps",
            "15",
            "--precisions",
            "32-true,bf16-mixed,16-mixed",
        ]
    return [
        "--image-size",
        "32",
        "--batch-size",
        "2",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--precisions",
        "32-true,bf16-mixed",
    ]


def precision_table(results: dict[str, dict[str, dict]], device: str) -> tuple[bool, str]:
    """``results[memory_format][precision] = {imgs_per_s, peak_mb}`` as one table, with the targets."""
    lines = [
        f"ResNet-50, {device}, one batch fed every step; peak memory = max allocated",
        "| precision | memory format | img/s | speed vs fp32 | peak MB | memory vs fp32 |",
        "|---|---|---|---|---|---|",
    ]
    best_bf16, amp_memory = 0.0, []
    for fmt, by_precision in results.items():
        base = by_precision.get("32-true")
        for prec, med in by_precision.items():
            speed = f"{med['imgs_per_s'] / base['imgs_per_s']:.2f}x" if base else "-"
            memory = med["peak_mb"] / base["peak_mb"] if base else None
            if prec != "32-true" and memory is not None:
                amp_memory.append(memory)
            if prec == "bf16-mixed":
                best_bf16 = max(best_bf16, med["imgs_per_s"])
            lines.append(
                f"| {prec} | {fmt} | {med['imgs_per_s']:.1f} | {speed} | {med['peak_mb']:.0f} | "
                + (f"{memory:.2f}x |" if memory is not None else "- |")
            )
    target = 2 * A100_AMP_IMAGES_PER_S
    lines.append(
        f"target bf16 >= {target} img/s (2x A100 AMP): best {best_bf16:.0f}, "
        f"{'MET' if best_bf16 >= target else 'MISSED'}; AMP peak memory <= 0.7x fp32: "
        + (
            f"worst {max(amp_memory):.2f}x, {'MET' if max(amp_memory) <= 0.7 else 'MISSED'}"
            if amp_memory
            else "-"
        )
    )
    return bool(results), "\n".join(lines)


def check_precision(device: str) -> tuple[bool, str]:
    import tempfile

    results: dict[str, dict[str, dict]] = {}
    for fmt, flag in (("contiguous", []), ("channels_last", ["--channels-last"])):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "benchmarks" / "bench_precision.py"),
                    "--device",
                    device,
                    "--rounds",
                    "1",
                    "--arch",
                    "resnet50",
                    "--json",
                    out.name,
                    *_precision_sizes(device),
                    *flag,
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if proc.returncode:
                return False, f"bench_precision.py ({fmt}) failed: {proc.stderr[-600:]}"
            results[fmt] = json.loads(Path(out.name).read_text())
    return precision_table(results, device)


def check_solo_vs_plain(device: str) -> tuple[bool, str]:
    import lightning as L
    import torch
    import torchvision
    from torch.utils.data import DataLoader, Dataset

    cuda = device == "cuda"
    arch, size, batch, warmup, steps, rounds = (
        ("resnet50", 224, 256, 5, 15, 2) if cuda else ("resnet18", 16, 2, 1, 1, 1)
    )
    precision = "bf16-mixed"
    fmt = torch.channels_last

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def network():
        torch.manual_seed(0)
        return torchvision.models.get_model(arch, num_classes=10).to(device, memory_format=fmt)

    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (batch,), device=device)
    if cuda:
        torch.backends.cudnn.benchmark = True

    def plain() -> float:
        net = network()
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        for i in range(warmup + steps):
            if i == warmup:
                start = now()
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return batch * steps / (now() - start)

    class SameBatch(Dataset):
        def __len__(self) -> int:
            return warmup + steps

        def __getitem__(self, i):
            return x, y

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = network()

        def training_step(self, b, batch_idx):
            return torch.nn.functional.cross_entropy(self.net(b[0]), b[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, b, batch_idx):
            if trainer.global_step == warmup:
                self.start = now()

        def on_train_end(self, trainer, pl_module):
            self.end = now()

    def solo() -> float:
        clock = Clock()
        trainer = _fit_solo(
            device,
            Net(),
            DataLoader(SameBatch(), batch_size=None),
            warmup + steps,
            [clock],
            precision=precision,
        )
        solo.backend = trainer.strategy.decisions["process_group_backend"].value
        return batch * steps / (clock.end - clock.start)

    figures: dict[str, list[float]] = {"plain": [], "solo": []}
    for _ in range(rounds):
        figures["plain"].append(plain())
        figures["solo"].append(solo())
    p_med, s_med = (statistics.median(figures[k]) for k in ("plain", "solo"))
    return True, (
        f"{arch} {precision} channels_last, batch {batch}, {size}px, {steps} timed steps, {rounds} round(s): plain "
        f"{p_med:.1f} img/s, SoloDDP ({solo.backend}, 1 device) {s_med:.1f} img/s, ratio {s_med / p_med:.3f}"
    )


def check_fsdp(device: str) -> tuple[bool, str]:
    import tempfile

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_solo.fsdp.consolidate import consolidate
    from lightning_solo.fsdp.strategy import SoloFSDP

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
            self.dtype_seen = None

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            self.dtype_seen = str(out.dtype)
            return torch.nn.functional.cross_entropy(out.float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    out = Path(tempfile.mkdtemp())
    data = TensorDataset(torch.randn(256, 64), torch.randint(0, 4, (256,)))
    accelerator = "gpu" if device == "cuda" else "cpu"
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, strategy=SoloFSDP(min_num_params=1000), max_steps=4,
        default_root_dir=out, logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Net()
    trainer.fit(model, DataLoader(data, batch_size=32))
    precision = trainer.strategy.decisions["fsdp_precision"].value
    manifest = consolidate(trainer.checkpoint_callback.best_model_path, out / "full.ckpt")
    plain = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    state = torch.load(out / "full.ckpt", weights_only=True)["state_dict"]
    plain.load_state_dict({k.removeprefix("net."): v for k, v in state.items()})
    want = "bf16-mixed" if device == "cuda" and torch.cuda.is_bf16_supported() else "32-true"
    ok = precision == want and manifest["global_step"] == 4
    return (
        ok,
        f"precision {precision} (compute {model.dtype_seen}); consolidated step {manifest['global_step']}",
    )


# ------------------------------------------------------------------ driver


def run_check(name: str, device: str, limit: float = 480) -> dict:
    """Run one check in a fresh interpreter, for at most ``limit`` seconds; returns {check, ok, detail, seconds}."""
    start = time.monotonic()
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--check", name, "--device", device],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=limit,
            env=env,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
        result = json.loads(line[len(RESULT) :]) if line else {"ok": False, "detail": proc.stderr[-800:]}
    except subprocess.TimeoutExpired:
        result = {"ok": False, "detail": f"timed out after {limit:.0f} s"}
    return {"check": name, **result, "seconds": round(time.monotonic() - start, 1)}


def render(rows: list[dict], device: str) -> str:
    lines = [f"GPU check ({device})", "", "| check | result | seconds | detail |", "|---|---|---|---|"]
    tables = []
    for row in rows:
        detail = row["detail"]
        if "\n" in detail:  # the precision benchmark's own table goes below
            tables.append(detail)
            detail = "table below"
        result = "SKIPPED" if row["ok"] is None else "PASS" if row["ok"] else "FAIL"
        lines.append(f"| {row['check']} | {result} | {row['seconds']} | {detail.replace('|', '/')} |")
    return "\n".join([*lines, "", *tables]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="also write the markdown table here")
    p.add_argument("--only", default=",".join(CHECKS), help=f"comma list of {CHECKS}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the logic without a GPU")
    p.add_argument("--budget", type=float, default=480, help="seconds for the whole run (default: 8 minutes)")
    p.add_argument("--check", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.check == "rewrap-rank":
        _rewrap_rank(args.device, args.rank, args.port, args.tmp)
        return 0
    if args.check == "fork-child":
        _fork_child()
        return 0
    if args.check:
        ok, detail = globals()[f"check_{args.check}"](args.device)
        print(RESULT + json.dumps({"ok": bool(ok), "detail": detail}), flush=True)
        return 0

    names = args.only.split(",")
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        p.error(f"unknown check(s) {unknown}; accepted: {CHECKS}")
    import torch  # is_available() does not initialise CUDA: the children may still fork

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: SKIPPED, CUDA is not available on this machine (nothing was checked). Run it where a "
            "GPU is, or pass --device cpu to exercise the logic on CPU."
        )
        return 0
    rows, started = [], time.monotonic()
    for name in names:
        left = args.budget - (time.monotonic() - started)
        if left < 20:  # not enough for a process start and a fit
            rows.append(
                {
                    "check": name,
                    "ok": None,
                    "detail": f"not run: the {args.budget:.0f} s budget is spent",
                    "seconds": 0,
                }
            )
        else:
            rows.append(run_check(name, args.device, limit=left))
        print(
            f"{name}: {render(rows[-1:], args.device).splitlines()[4].split(' | ')[1]} ({rows[-1]['seconds']} s)",
            flush=True,
        )
    table = render(rows, args.device)
    print("\n" + table)
    if args.out:
        args.out.write_text(table)
    return 0 if all(row["ok"] is True for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
