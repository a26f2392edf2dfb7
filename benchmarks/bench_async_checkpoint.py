"""Training time blocked per checkpoint save: synchronous SoloCheckpointIO, SoloCheckpoint(async_save=True),
Lightning's AsyncCheckpointIO and stock TorchCheckpointIO, on a slow disk (a fixed delay per file) and the real one.

One process, one Lightning fit per variant and round (variants interleaved, order rotated each round): a stack of
Linear layers whose weights + SGD momentum make a ``--mb`` MiB checkpoint, saved every ``--interval`` s (3 saves,
``save_last=False``, one file per save). Per save, ``blocked`` = the saving step's time minus the median plain step;
``during write`` = median step time in the 1 s after a save over the 1 s before it (the CPU the
background write takes from training); ``snapshot`` = HostStaging's copy of the state alone. Medians over rounds.

    python benchmarks/bench_async_checkpoint.py --mb 100 --delay 5 --rounds 3     # slow disk, 5 s per file
    python benchmarks/bench_async_checkpoint.py --mb 100 --delay 0 --rounds 3     # the real disk
    python benchmarks/bench_async_checkpoint.py --mb 1024 --delay 5 --rounds 1    # ~1 GB (memory and time)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn

from lightning_solo.callbacks import SoloCheckpoint
from lightning_solo.checkpoint import SoloCheckpointIO
from lightning_solo.checkpoint.background import HostStaging

DELAY = 0.0
WINDOW_S = 1.0  # the steps this long after a save, against those this long before it


class SlowSolo(SoloCheckpointIO):
    def write_file(self, checkpoint, path, manifest):  # sync and async both write here
        super().write_file(checkpoint, path, manifest)
        time.sleep(DELAY)  # after the write, so its CPU use falls in the steps right after the save


class SlowTorch(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        super().save_checkpoint(checkpoint, path, storage_options)
        time.sleep(DELAY)


class Big(L.LightningModule):
    def __init__(self, mb: int) -> None:
        super().__init__()
        side = int((mb * (1 << 20) / 8 / 4) ** 0.5)  # 4 square layers; weights + momentum = mb MiB
        self.layers = nn.Sequential(*(nn.Linear(side, side, bias=False) for _ in range(4)))
        self.side = side

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6, momentum=0.9)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, self.side))
        return torch.utils.data.DataLoader(data, batch_size=8)


class StepTimes(L.Callback):
    """Each step's start and end; the steps whose end saved (the checkpoint callback runs after this one)."""

    def __init__(self, saves: int) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.saving: list[int] = []
        self.saves = saves

    def on_train_batch_start(self, trainer, *args):
        self.starts.append(time.perf_counter())
        trainer.should_stop = len(self.saving) >= self.saves

    def on_train_batch_end(self, trainer, *args):
        self.ends.append(time.perf_counter())


def run(variant: str, mb: int, interval_s: float, saves: int, root: str) -> dict:
    ckpt_dir = tempfile.mkdtemp(dir=root)
    kw = {"dirpath": ckpt_dir, "train_time_interval": timedelta(seconds=interval_s), "save_last": False}
    plugins, callback = {
        "solo sync": ([SlowSolo()], SoloCheckpoint(**kw)),
        "solo async": ([SlowSolo()], SoloCheckpoint(**kw, async_save=True)),
        "lightning AsyncCheckpointIO": ([AsyncCheckpointIO(SlowTorch())], ModelCheckpoint(**kw)),
        "stock TorchCheckpointIO": ([SlowTorch()], ModelCheckpoint(**kw)),
    }[variant]
    times = StepTimes(saves)
    save = callback._save_checkpoint

    def marked(trainer, filepath):
        times.saving.append(len(times.ends) - 1)
        save(trainer, filepath)

    callback._save_checkpoint = marked  # type: ignore[method-assign]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=-1,
        callbacks=[times, callback],
        plugins=plugins,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(Big(mb))
    total = time.perf_counter() - start  # includes the fit's end waiting for writes still running
    starts, ends = times.starts, times.ends
    steps = [b - a for a, b in itertools.pairwise(starts)]
    saving = set(times.saving)
    plain = statistics.median(s for i, s in enumerate(steps) if i not in saving and i > 2)
    blocked = [starts[i + 1] - ends[i] for i in sorted(saving) if i + 1 < len(starts)]

    def window(lo: float, hi: float) -> list[float]:
        return [s for i, s in enumerate(steps) if i not in saving and lo <= starts[i] < hi]

    after = [s for j in saving if j + 1 < len(starts) for s in window(starts[j + 1], starts[j + 1] + WINDOW_S)]
    before = [s for j in saving for s in window(ends[j] - WINDOW_S, ends[j])]
    return {
        "blocked_s": statistics.median(blocked),
        "step_s": plain,
        "during_write": statistics.median(after) / statistics.median(before) if after and before else float("nan"),
        "fit_s": total,
    }


def snapshot_time(mb: int) -> float:
    module = Big(mb)
    state = {
        "state_dict": module.state_dict(),
        "momentum": {k: v.clone() for k, v in module.state_dict().items()},
    }
    staging, times = HostStaging(), []
    for _ in range(3):
        start = time.perf_counter()
        staging.snapshot(state)
        times.append(time.perf_counter() - start)
        staging.close_group()
        staging.release()
    return statistics.median(times[1:])  # buffers reused, as from the second save on


def main() -> None:
    global DELAY
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--delay", type=float, default=5.0, help="seconds added to each file's write")
    parser.add_argument("--interval", type=float, default=0.0, help="seconds between saves (default 1.5 delay + 3)")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on /tmp's disk)")
    args = parser.parse_args()
    DELAY = args.delay
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    root = args.dir or tempfile.mkdtemp(prefix="bench_async_")
    variants = ["solo sync", "solo async", "lightning AsyncCheckpointIO", "stock TorchCheckpointIO"]
    # Time between saves: longer than a write, so a steady-state save never waits for the one before.
    interval = args.interval or 1.5 * args.delay + 3.0
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            results[v].append(run(v, args.mb, interval, args.saves, root))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)  # several GB of checkpoints at --mb 1024
    snap = snapshot_time(args.mb)
    table = {v: {k: statistics.median(res[k] for res in rs) for k in rs[0]} for v, rs in results.items()}
    print(json.dumps({"mb": args.mb, "delay_s": args.delay, "interval_s": interval, "rounds": args.rounds,
                      "snapshot_s": snap, "results": table}, indent=1))  # fmt: skip
    print(f"\n{args.mb} MiB, write delay {args.delay} s/file, a save every {interval:.1f} s, {args.rounds} rounds")
    print(f"snapshot copy alone: {snap * 1000:.0f} ms")
    print(f"{'variant':30s} {'blocked/save':>13s} {'one step':>9s} {'steps during write':>18s}")
    for v, row in table.items():
        print(f"{v:30s} {row['blocked_s']:12.3f}s {row['step_s'] * 1000:7.0f}ms {row['during_write']:17.2f}x")


if __name__ == "__main__":
    main()
