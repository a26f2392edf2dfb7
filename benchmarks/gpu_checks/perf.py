"""The benchmarks: the cost of the defaults (ResNet-50 bf16 channels_last: a plain loop, stock DDPStrategy, SoloDDP,
the runner's callbacks), run first, and the precision benchmark, run last."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

from benchmarks.gpu_checks.common import now, runner_callbacks, trainer
from benchmarks.gpu_checks.harness import ROOT, child_env
from lightning_solo import SoloDDP
from lightning_solo.testing import HostSyncRecorder

#: NVIDIA's published ResNet-50 AMP training throughput on one A100 (images/s); the target is twice it.
A100_AMP_IMAGES_PER_S = 2470


def _precision_args(device: str) -> list[str]:
    """ResNet-50 at 224² × 256 on a GPU; on CPU ResNet-18 at 32² × 2, one step, bf16 alone (each precision is a
    fresh worker process): the logic, not the figures."""
    arch, size, batch, warmup, steps, precisions = (
        ("resnet50", 224, 256, 5, 15, "32-true,bf16-mixed,16-mixed")
        if device == "cuda"
        else ("resnet18", 32, 2, 1, 1, "bf16-mixed")
    )
    sizes = {
        "--arch": arch,
        "--image-size": size,
        "--batch-size": batch,
        "--warmup": warmup,
        "--steps": steps,
    }
    return [*(str(v) for kv in sizes.items() for v in kv), "--precisions", precisions]


def precision_table(results: dict[str, dict[str, dict]], device: str) -> tuple[bool, str]:
    """``results[memory_format][precision] = {imgs_per_s, peak_mb}`` as one table, with the targets."""
    lines = [
        f"ResNet-{50 if device == 'cuda' else 18}, {device}, one batch fed every step; peak memory = max allocated after the warm-up",
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
        + (f"worst {max(amp_memory):.2f}x, {'MET' if max(amp_memory) <= 0.7 else 'MISSED'}" if amp_memory else "-")
    )
    return bool(results), "\n".join(lines)


def check_precision(device: str) -> tuple[bool, str]:
    """``bench_precision.py`` on ResNet-50 channels_last (the layout the GPU's convolutions want): strict fp32,
    bf16-mixed, 16-mixed; images/s and the peak memory of the timed steps."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        script = str(ROOT / "benchmarks" / "bench_precision.py")
        options = ["--device", device, "--rounds", "1", "--json", out.name, "--channels-last"]
        bench = [sys.executable, script, *options, *_precision_args(device)]
        # child_env: its workers import lightning_solo from this checkout (a check forked on CPU has no such env)
        proc = subprocess.run(bench, cwd=ROOT, env=child_env(), capture_output=True, text=True)
        if proc.returncode:
            return False, f"bench_precision.py failed: {proc.stderr[-600:]}"
        return precision_table({"channels_last": json.loads(Path(out.name).read_text())}, device)


# arch, image size, batches (the second small, where per-step overhead shows), warm-up steps (the last `recorded`
# of them counted for host syncs), timed steps, recorded steps, rounds. The callbacks measure on their first 8 steps
# (ResourceMonitor's pace, the unused-parameter window and its re-wrap): the counted steps come after.
# CPU: 4 images of 32 px, so that BatchNorm's last stage sees 4 values per channel (2 diverged now and then).
_SIZES = {"cuda": ("resnet50", 224, (256, 16), 11, 8, 3, 2), "cpu": ("resnet18", 32, (4,), 10, 2, 2, 1)}
STOCK = "DDPStrategy()"
#: ms per step against stock Lightning's DDPStrategy at the same batch (GPU only).
_SLOWER = {"SoloDDP()": 1.05, "SoloDDP(find_unused_parameters=False)": 1.05, "SoloDDP() + runner callbacks": 1.10}


def _network(arch: str, device: str) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.get_model(arch, num_classes=10).to(device, memory_format=torch.channels_last)


class _Net(L.LightningModule):
    """The network, SGD with momentum, ``train/loss`` logged as the runner's model logs it."""

    def __init__(self, arch: str, device: str) -> None:
        super().__init__()
        self.net = _network(arch, device)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class _SameBatch(Dataset):
    def __init__(self, batch, length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):
        return self.batch


class _Measure(L.Callback):
    """Records host syncs from the start (so the tensors the fit makes are known as the device's, as on a GPU)
    and counts them on steps [warmup - recorded, warmup), after every callback's measuring steps; then, with the
    recorder off, times steps [warmup, warmup + timed)."""

    def __init__(self, device: str, batch: tuple, warmup: int, timed: int, recorded: int) -> None:
        self.device, self.batch, self.first, self.last = device, batch, warmup, warmup + timed
        self.counted = range(warmup - recorded, warmup)

    def on_train_start(self, trainer, pl_module):
        progress = trainer.fit_loop.epoch_loop.batch_progress.total
        self.recorder = HostSyncRecorder(trainer.strategy.root_device, step=lambda: progress.ready - 1)
        self.recorder.watch(pl_module, *self.batch).__enter__()  # the batch lives on the device too

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.first - 1:
            self.recorder.__exit__(None, None, None)
            self.per_step = [sum(1 for e in self.recorder.events if e.step == s) for s in self.counted]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.first:
            self.start = now(self.device)
        if batch_idx == self.last:
            self.seconds = now(self.device) - self.start


def check_defaults_cost(device: str) -> tuple[bool, str]:
    """ResNet-50 bf16 channels_last, the same batch every step, at batch 256 and at 16 (where per-step overhead
    shows): a plain loop, stock ``DDPStrategy()``, bare ``SoloDDP()``, ``SoloDDP(find_unused_parameters=False)`` and
    ``SoloDDP()`` with the runner's default callbacks, interleaved rounds. ms per step (median) against stock's
    (≤ 1.05x, 1.10x with the callbacks; on GPU only) and host syncs per step on steps nothing is logged at (≤ 1: the
    fast path's documented read)."""
    arch, size, batches, warmup, timed, recorded, rounds = _SIZES[device]
    torch.backends.cudnn.benchmark = device == "cuda"
    ok, tables = True, []
    for batch in batches:
        batch_ok, table = _defaults_cost_at(device, arch, size, batch, warmup, timed, recorded, rounds)
        ok, tables = ok and batch_ok, [*tables, table]
    return ok, "\n\n".join(tables)


def _defaults_cost_at(device, arch, size, batch, warmup, timed, recorded, rounds) -> tuple[bool, str]:
    torch.manual_seed(0)
    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)

    def plain() -> tuple[float, list[int]]:
        net = _network(arch, device)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        recorder = HostSyncRecorder(device).watch(net, x, y)

        def step() -> None:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for i in range(warmup + timed):
            if i == warmup:
                start = now(device)
            step()
        seconds = now(device) - start
        per_step = []
        for _ in range(recorded):
            with recorder:
                step()
            per_step.append(len(recorder.events) - sum(per_step))
        return seconds, per_step

    def lightning(strategy, callbacks: bool) -> tuple[float, list[int]]:
        from lightning.pytorch.loggers import CSVLogger

        measure = _Measure(device, (x, y), warmup, timed, recorded)
        with tempfile.TemporaryDirectory() as out:
            extra = runner_callbacks(Path(out), batch) if callbacks else []
            # A logger writing every 50 steps, as the runner's: every measured step is one nothing is logged at.
            fit = trainer(device, warmup + timed + 1, [*extra, measure], strategy(),
                          precision="bf16-mixed", logger=CSVLogger(out), log_every_n_steps=50,
                          enable_checkpointing=callbacks, default_root_dir=out)  # fmt: skip
            fit.fit(
                _Net(arch, device),
                DataLoader(_SameBatch((x, y), warmup + timed + 1), batch_size=None),
            )
        return measure.seconds, measure.per_step

    variants = {
        "plain loop": plain,
        STOCK: lambda: lightning(DDPStrategy, False),
        "SoloDDP()": lambda: lightning(SoloDDP, False),
        "SoloDDP(find_unused_parameters=False)": lambda: lightning(
            lambda: SoloDDP(find_unused_parameters=False), False
        ),
        "SoloDDP() + runner callbacks": lambda: lightning(SoloDDP, True),
    }
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    syncs: dict[str, int] = dict.fromkeys(variants, 0)
    for _ in range(rounds):
        for name, run in variants.items():
            took, per_step = run()
            seconds[name].append(took / timed * 1e3)
            syncs[name] = max(syncs[name], *per_step)
    base, stock = statistics.median(seconds["plain loop"]), statistics.median(seconds[STOCK])
    lines = [f"{arch} bf16 channels_last, batch {batch}, {size}px, {timed} timed steps, {rounds} round(s), {device}",
             "| setup | ms/step | vs plain | vs stock | bound | host syncs/step (max) | bound | verdict |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    ok = True
    for name in variants:
        ms = statistics.median(seconds[name])
        bound = _SLOWER.get(name)
        fast = bound is None or device != "cuda" or ms <= bound * stock
        quiet = name in ("plain loop", STOCK) or syncs[name] <= syncs[STOCK]
        ok = ok and fast and quiet
        shown = f"≤ {bound:.2f}x stock" + ("" if device == "cuda" else " (GPU only)") if bound else "-"
        lines.append(f"| {name} | {ms:.1f} | {ms / base:.3f}x | {ms / stock:.3f}x | {shown} | {syncs[name]} | "
                     f"{'-' if name in ('plain loop', STOCK) else f'≤ {syncs[STOCK]}'} | {'PASS' if fast and quiet else 'FAIL'} |")  # fmt: skip
    return ok, "\n".join(lines)
