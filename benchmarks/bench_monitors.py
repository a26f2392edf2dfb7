"""Per-step cost of LossWatch and ResourceMonitor: the runner's quick_cpu workload (ResNet-18, 16x16 synthetic
images, 32 per device, 2 gloo processes x 1 thread), the callbacks switched on and off in blocks of steps
inside ONE fit, in a rotating order, so every setting sees the same machine load. Two figures per setting: the
median over rotations of (its block's median step time / the 'off' block's of that rotation), and the time
spent inside the callbacks' hooks per step (median; wall and this thread's CPU) as a share of the 'off' step time,
which stays readable on a loaded machine where step times swing by tens of percent.

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
from lightning_solo.app.data import SyntheticDataModule
from lightning_solo.app.models import ImageClassifier
from lightning_solo.callbacks import LossWatch, ResourceMonitor

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
        self.spent: dict[int, list[float]] = {}  # step -> [wall s, CPU s] inside the inner hooks
        for hook in _GATED:
            setattr(self, hook, self._gate(hook))

    def _gate(self, hook):
        def call(trainer, *args, **kwargs):
            if self.active(self.step):  # the step this batch started as (batch end sees the next one)
                wall, cpu = time.perf_counter(), time.thread_time()
                getattr(self.inner, hook)(trainer, *args, **kwargs)
                spent = self.spent.setdefault(self.step, [0.0, 0.0])
                spent[0] += time.perf_counter() - wall
                spent[1] += time.thread_time() - cpu

        return call

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step

    def setup(self, trainer, pl_module, stage):
        self.inner.setup(trainer, pl_module, stage)

    def on_train_start(self, trainer, pl_module):
        self.inner.on_train_start(trainer, pl_module)


class StepTimer(L.Callback):
    def __init__(self, out: Path, gated: list[Gated]) -> None:
        self.out, self.starts, self.gated = out, [], gated

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append((trainer.global_step, time.perf_counter()))

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            times = [(s, b - a) for (s, a), (_, b) in zip(self.starts, self.starts[1:])]
            spent: dict[int, list[float]] = {}
            for g in self.gated:
                for step, (wall, cpu) in g.spent.items():
                    total = spent.setdefault(step, [0.0, 0.0])
                    total[0], total[1] = total[0] + wall, total[1] + cpu
            self.out.write_text(json.dumps({"times": times, "spent": spent}))


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
        callbacks=[*callbacks, StepTimer(out, callbacks)],
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    result = json.loads(out.read_text())
    spent = {int(step): v for step, v in result["spent"].items()}
    by_block: dict[tuple[int, str], list[float]] = {}
    inside: dict[str, list[tuple[float, float]]] = {}
    for step, seconds in result["times"]:
        if step >= args.warmup:
            rotation = (step - args.warmup) // (args.block * len(names))
            by_block.setdefault((rotation, setting_at(step)), []).append(seconds)
            inside.setdefault(setting_at(step), []).append(tuple(spent.get(step, (0.0, 0.0))))
    off = {rot: statistics.median(v) for (rot, name), v in by_block.items() if name == "off"}
    print(
        f"load average {os.getloadavg()[0]:.1f}; {args.rotations} rotations x {args.block} steps; image {args.image_size}"
    )
    off_step = statistics.median(off.values())
    print(f"{'setting':28s} {'ms/step':>8s} {'step ratio':>10s} {'rotations':>12s} {'in hooks ms':>11s} "
          f"{'(CPU ms)':>8s} {'in-hook share':>13s}")  # fmt: skip
    for name in (n for n in names if n in inside):
        meds = {rot: statistics.median(v) for (rot, n), v in by_block.items() if n == name}
        ratios = [meds[rot] / off[rot] for rot in meds]
        wall = statistics.median(w for w, _ in inside[name])
        cpu = statistics.median(c for _, c in inside[name])
        print(f"{name:28s} {1000 * statistics.median(meds.values()):8.1f} {statistics.median(ratios):10.3f} "
              f"{min(ratios):5.2f}-{max(ratios):.2f} {1000 * wall:11.2f} {1000 * cpu:8.2f} "
              f"{wall / off_step:12.2%}")  # fmt: skip


if __name__ == "__main__":
    main()
