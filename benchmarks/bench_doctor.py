"""What TrainingDoctor costs: training throughput with the doctor on and off, interleaved, medians.

Three measurements, each on 2 processes (SoloDDP's fork launcher, gloo on CPU; ``--device cuda`` for GPUs),
fed precomputed batches (no loader work, so the doctor's per-step cost is as large a share as it gets):

* ``fits``: whole fits with the doctor on and off, the order alternating each round; throughput timed on rank
  0 from the end of the warm-up to the last step. The doctor's one-time end-of-training report (gather,
  table, doctor.json, doctor.png) is timed apart. Between fits the machine's load moves too, so:
* ``blocks``: one fit per round whose doctor is switched on and off every ``--block`` steps (same processes,
  same data, adjacent in time); each on block is compared with the mean of its two off neighbours, per wall
  second and per CPU second of rank 0's process (which other jobs' load does not inflate).
  DDP's timer runs at the doctor's sample rate throughout, so this is what the doctor's own hooks cost;
* ``ddp``: what that sample rate costs inside DDP: raw DDP, two identical wrappers stepping in alternating
  blocks, one timed every iteration and one at DDP's default (every 100th), the roles swapped each round.

The overhead is 1 - the median of the paired on/off ratios. The fits also time the doctor's per-step hooks
directly (rank 0): their share of the step is the cost on the host, insensitive to the machine's load.

Usage::

    python benchmarks/bench_doctor.py                                  # CPU: mlp and resnet18, all three
    python benchmarks/bench_doctor.py --modes blocks,ddp --workloads mlp --rounds 6
    python benchmarks/bench_doctor.py --device cuda --devices 1 --workloads resnet18 --batch-size 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

STEPS = {"mlp": 400, "resnet18": 20}  # timed steps per fit


def _parts(args: argparse.Namespace, workload: str):
    import torch
    import torchvision
    from torch import nn

    shape = (3, args.image_size, args.image_size) if workload == "resnet18" else (256,)
    batch = args.batch_size or (16 if workload == "resnet18" else 64)

    def model() -> nn.Module:
        if workload == "resnet18":
            net = torchvision.models.resnet18(num_classes=10)
            net.conv1, net.maxpool = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.Identity()
            return net
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    data = torch.randn(8, batch, *shape), torch.randint(10, (8, batch))
    return model, data, batch


def fit(args: argparse.Namespace, workload: str, doctor: bool | str, out: Path) -> dict:
    """One fit; ``doctor``: True, False or "toggle" (on and off every ``args.block`` steps)."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset

    from lightning_solo import SoloDDP
    from lightning_solo.callbacks import TrainingDoctor

    model, (xs, ys), batch_size = _parts(args, workload)
    steps = args.steps or STEPS[workload]
    if doctor == "toggle":
        steps = 2 * args.block * args.pairs + args.block

    class Batches(Dataset):
        def __len__(self) -> int:
            return args.warmup + steps

        def __getitem__(self, i):
            return xs[i % 8], ys[i % 8]

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        def train_dataloader(self):
            return DataLoader(Batches(), batch_size=None)

    class Bench(L.Callback):
        """Forwards the doctor's hooks (all of them, or every other block), times the steps on rank 0."""

        def __init__(self) -> None:
            self.doctor = TrainingDoctor() if doctor else None
            self.on, self.marks, self.blocks = bool(doctor), {}, []
            self.inside = 0.0  # seconds spent in the doctor's per-step hooks during the timed steps

        def setup(self, trainer, pl_module, stage):
            self.callbacks = [self.doctor] if self.doctor else []

        def on_train_start(self, trainer, pl_module):
            for cb in self.callbacks:
                cb.on_train_start(trainer, pl_module)

        def _call(self, trainer, hook, *hook_args):
            if self.on:
                started = time.perf_counter()
                getattr(self.doctor, hook)(trainer, *hook_args)
                if 0 <= trainer.global_step - args.warmup < steps:
                    self.inside += time.perf_counter() - started

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._call(trainer, "on_train_batch_start", pl_module, batch, batch_idx)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self._call(trainer, "on_before_optimizer_step", pl_module, optimizer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._call(trainer, "on_train_batch_end", pl_module, outputs, batch, batch_idx)
            step = trainer.global_step - args.warmup
            if step == 0:
                self.marks["start"] = self.marks["block"] = time.perf_counter()
                self.marks["cpu"] = time.process_time()
            elif step == steps:
                self.marks["stop"] = time.perf_counter()
            if doctor == "toggle" and step >= 0 and step % args.block == 0:
                if step:
                    now, cpu = time.perf_counter(), time.process_time()
                    samples = args.block * batch_size * trainer.world_size
                    wall, busy = now - self.marks["block"], cpu - self.marks["cpu"]
                    self.blocks.append((self.on, samples / wall, samples / busy))
                    self.marks["block"], self.marks["cpu"] = now, cpu
                self.on = not self.on if step else False  # off, on, off, ... from the warm-up's end

        def on_train_end(self, trainer, pl_module):
            started = time.perf_counter()
            for cb in self.callbacks:
                cb.on_train_end(trainer, pl_module)
            if trainer.is_global_zero:
                seconds = self.marks["stop"] - self.marks["start"]
                record = {
                    "samples_per_s": steps * batch_size * trainer.world_size / seconds,
                    "report_seconds": time.perf_counter() - started,
                    "inside": self.inside / seconds,
                    "blocks": self.blocks,
                }
                (out / "record.json").write_text(json.dumps(record))

    trainer = L.Trainer(
        accelerator=args.device, devices=args.devices, max_steps=args.warmup + steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False, default_root_dir=out, strategy=SoloDDP(start_method="fork"),
        callbacks=[Bench()],
    )  # fmt: skip
    trainer.fit(Net())
    return json.loads((out / "record.json").read_text())


def ddp_timer(args: argparse.Namespace, workload: str) -> list[float]:
    """Raw DDP, per round: step time at sample rate 1 / at DDP's default, the two wrappers' roles swapped."""
    from lightning_solo.testing import run_ranks

    return run_ranks(_ddp_timer_rank, args.devices, args, workload, timeout=1800)[0]


def _ddp_timer_rank(rank: int, world: int, args: argparse.Namespace, workload: str) -> list[float]:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from lightning_solo._compat import torch as torch_compat

    model, (xs, ys), _ = _parts(args, workload)
    torch.manual_seed(0)
    wrappers = [DistributedDataParallel(model()) for _ in range(2)]
    optimizers = [torch.optim.SGD(w.parameters(), lr=0.01) for w in wrappers]

    def block(i: int) -> float:
        started = time.perf_counter()
        for s in range(args.block):
            optimizers[i].zero_grad()
            F.cross_entropy(wrappers[i](xs[s % 8]), ys[s % 8]).backward()
            optimizers[i].step()
        return time.perf_counter() - started

    block(0), block(1)  # warm-up, bucket rebuild
    ratios = []
    for r in range(args.rounds * args.pairs):
        timed = r % 2  # which wrapper times every iteration this round
        for i in range(2):
            torch_compat.set_ddp_runtime_logging_sample_rate(wrappers[i], 1 if i == timed else 100)
        seconds = {i: block(i) for i in ((0, 1) if r % 4 < 2 else (1, 0))}
        ratios.append(seconds[1 - timed] / seconds[timed])  # throughput timed / untimed
    return ratios


def _neighbour_ratios(blocks: list[tuple[bool, float, float]], which: int = 1) -> list[float]:
    """Each on block's throughput over the mean of the off blocks on either side (``which``: 1 per wall
    second, 2 per CPU second of rank 0's process)."""
    return [
        block[which] / ((blocks[i - 1][which] + blocks[i + 1][which]) / 2)
        for i, block in enumerate(blocks)
        if block[0] and 0 < i < len(blocks) - 1
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="fits,blocks,ddp")
    parser.add_argument("--workloads", default="mlp,resnet18")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per fit (default: per workload)")
    parser.add_argument("--block", type=int, default=None, help="steps per on/off block (default: 25 mlp, 4 resnet18)")
    parser.add_argument("--pairs", type=int, default=4, help="on/off block pairs per fit or round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--image-size", type=int, default=16, help="resnet18's input (CIFAR stem)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    modes, rows = args.modes.split(","), []
    block = args.block
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads.split(","):
            args.block = block or (25 if workload == "mlp" else 4)
            if "fits" in modes:
                ratios, on, off, reports, inside = [], [], [], [], []
                for r in range(args.rounds):
                    got = {}
                    for doctor in (True, False) if r % 2 == 0 else (False, True):
                        record = fit(args, workload, doctor, Path(tmp))
                        got[doctor] = record["samples_per_s"]
                        if doctor:
                            reports.append(record["report_seconds"])
                            inside.append(record["inside"])
                    on.append(got[True])
                    off.append(got[False])
                    ratios.append(got[True] / got[False])
                    print(f"{workload} fits, round {r + 1}: on {got[True]:.1f}, off {got[False]:.1f} samples/s", flush=True)  # fmt: skip
                rows.append((workload, "fits", ratios, f"{statistics.median(on):.1f} / {statistics.median(off):.1f}", f"{statistics.median(reports):.2f} s"))  # fmt: skip
                rows.append((workload, "time inside the doctor's hooks / step time (fits on)", [1 - x for x in inside], "", ""))  # fmt: skip
            if "blocks" in modes:
                ratios, cpu = [], []
                for r in range(args.rounds):
                    blocks = fit(args, workload, "toggle", Path(tmp))["blocks"]
                    ratios += _neighbour_ratios(blocks)
                    cpu += _neighbour_ratios(blocks, which=2)
                    print(f"{workload} blocks, round {r + 1}: wall {[round(x, 3) for x in ratios]}, cpu {[round(x, 3) for x in cpu]}", flush=True)  # fmt: skip
                rows.append((workload, f"blocks of {args.block} steps, per wall second", ratios, "", ""))
                rows.append((workload, f"blocks of {args.block} steps, per CPU second (rank 0)", cpu, "", ""))
            if "ddp" in modes:
                ratios = ddp_timer(args, workload)
                print(f"{workload} ddp timer: {[round(x, 3) for x in ratios]}", flush=True)
                rows.append((workload, f"DDP timer, blocks of {args.block}", ratios, "", ""))
    print("\n| workload | measurement | pairs | overhead (1 - median on/off) | on/off ratio min-max | samples/s on / off (medians) | end-of-fit report |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for workload, what, ratios, speeds, report in rows:
        print(f"| {workload} | {what} | {len(ratios)} | {1 - statistics.median(ratios):+.1%} | {min(ratios):.3f}-{max(ratios):.3f} | {speeds} | {report} |")  # fmt: skip


if __name__ == "__main__":
    main()
