"""Per-step cost of LossWatch and ResourceMonitor: the runner's quick_cpu workload (ResNet-18, 16x16 synthetic
images, 32 per device, 2 gloo processes x 1 thread), the callbacks switched on and off in blocks of steps
inside ONE fit, in a rotating order, so every setting sees the same machine load; the figure per setting is the
median over rotations of (its block's median step time / the median of the 'off' block of that rotation).

Settings: off · LossWatch() (the default: loss + gradient-norm check, one 3-float all-reduce per step, a rank
spread check every 50 steps) · LossWatch(check_grad_norm=False) · ResourceMonitor(every_n_steps=1) (the worst case:
a psutil sample and an all-gather every step; the default samples every ~30 s) · both defaults.

    python benchmarks/bench_monitors.py                    # ~3 minutes on 2 idle cores
    python benchmarks/bench_monitors.py --rotations 10 --block 10 --image-size 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from lightning_solo import SoloDDP
from lightning_solo.callbacks import LossWatch, ResourceMonitor
from lightning_solo.data import SyntheticDataModule
from lightning_solo.models import ImageClassifier

SETTINGS = {
    "off": [],
    "loss_watch": [lambda: LossWatch()],
    "loss_watch_no_grad_norm": [lambda: LossWatch(check_grad_norm=False)],
    "resource_monitor_every_step": [lambda: ResourceMonitor(every_n_steps=1)],
    "both_defaults": [lambda: LossWatch(), lambda: ResourceMonitor()],
}
_GATED = ("on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


class Gated(L.Callback):
    """Forwards the per-step hooks to ``inner`` only in the steps ``active(step)`` says; set-up hooks always."""

    def __init__(self, inner: L.Callback, active) -> None:
        self.inner, self.active, self.step = inner, active, 0
        for hook in _GATED:
            setattr(self, hook, self._gate(hook))

    def _gate(self, hook):
        def call(trainer, *args, **kwargs):
            if self.active(self.step):  # the step this batch started as (batch end sees the next one)
                getattr(self.inner, hook)(trainer, *args, **kwargs)

        return call

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step

    def setup(self, trainer, pl_module, stage):
        self.inner.setup(trainer, pl_module, stage)

    def on_train_start(self, trainer, pl_module):
        self.inner.on_train_start(trainer, pl_module)


class StepTimer(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.starts = out, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append((trainer.global_step, time.perf_counter()))

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            times = [(s, b - a) for (s, a), (_, b) in zip(self.starts, self.starts[1:])]
            self.out.write_text(json.dumps(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rotations", type=int, default=6)
    parser.add_argument("--block", type=int, default=8, help="steps per setting per rotation")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps first")
    parser.add_argument("--image-size", type=int, default=16)
    args = parser.parse_args()
    names = list(SETTINGS)
    schedule: list[str] = []  # the setting of each timed step, rotation after rotation, order rotated
    for r in range(args.rotations):
        order = names[r % len(names) :] + names[: r % len(names)]
        schedule += [name for name in order for _ in range(args.block)]
    steps = args.warmup + len(schedule)

    def setting_at(step: int) -> str:
        return schedule[step - args.warmup] if 0 <= step - args.warmup < len(schedule) else "off"

    callbacks = [
        Gated(make(), lambda step, name=name: setting_at(step) == name)
        for name, makers in SETTINGS.items()
        for make in makers
    ]
    out = Path(tempfile.mkdtemp()) / "times.json"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dm = SyntheticDataModule(image_size=args.image_size, train_size=2 * 32 * (steps + 1), batch_size=32)
    model = ImageClassifier(
        "resnet18", num_classes=10, optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=SoloDDP(start_method="fork"), max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
        callbacks=[*callbacks, StepTimer(out)],
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    times = json.loads(out.read_text())
    by_block: dict[tuple[int, str], list[float]] = {}
    for step, seconds in times:
        if step >= args.warmup:
            rotation = (step - args.warmup) // (args.block * len(names))
            by_block.setdefault((rotation, setting_at(step)), []).append(seconds)
    off = {rot: statistics.median(v) for (rot, name), v in by_block.items() if name == "off"}
    print(
        f"load average {os.getloadavg()[0]:.1f}; {args.rotations} rotations x {args.block} steps; image {args.image_size}"
    )
    print(f"{'setting':30s} {'ms/step':>8s} {'ratio vs off':>13s} {'per-rotation range':>20s}")
    for name in names:
        meds = {rot: statistics.median(v) for (rot, n), v in by_block.items() if n == name}
        ratios = [meds[rot] / off[rot] for rot in meds]
        print(f"{name:30s} {1000 * statistics.median(meds.values()):8.1f} {statistics.median(ratios):13.3f} "
              f"{min(ratios):9.3f}-{max(ratios):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
