"""Peak memory and throughput of fp32 vs TF32 vs bf16-mixed vs 16-mixed for a torchvision ResNet (``--arch``).

Each (round, precision) runs in a fresh subprocess, through a Lightning Trainer with the plugin SoloDDP
would install (``Precision()`` for 32-true/32-tf32, :class:`SoloMixedPrecision` otherwise). Precisions are
interleaved and their order rotates every round; the figures are medians over rounds.

What is measured is the precision, not the input pipeline: one batch is generated once, on the device, and
fed every step (no host-to-device copy); on CUDA ``cudnn.benchmark`` autotunes the convolutions. ``32-true``
is strict fp32 (TF32 off for matmuls *and* cuDNN, whose default is on); ``32-tf32`` is fp32 with TF32
allowed, its own row (on CPU it is the same as fp32: there is no TF32).

Memory:
* CPU: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of the fresh process, which is why each measurement
  gets its own process (tracemalloc does not see torch's allocator). ``peak`` is the whole process;
  ``train`` is the peak minus the high-water mark just before ``fit`` (model, data and libraries loaded).
* CUDA: ``torch.cuda.max_memory_allocated`` over the timed steps: ``reset_peak_memory_stats`` after the warm-up,
  so cuDNN's autotuning workspaces (``cudnn.benchmark`` tries every algorithm on the first steps) do not count.

Usage::

    python benchmarks/bench_precision.py                              # CPU, small images (this machine)
    python benchmarks/bench_precision.py --device cuda --image-size 224 --batch-size 128 --steps 30 \
        --warmup 5 --channels-last                                    # adds the 32-tf32 row by default
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ALL_PRECISIONS = ("32-true", "32-tf32", "bf16-mixed", "16-mixed")
CPU_DEFAULT = ("32-true", "bf16-mixed", "16-mixed")  # TF32 does not exist on CPU


def worker(args: argparse.Namespace) -> dict:
    import lightning as L
    import torch
    import torchvision
    from lightning.pytorch.plugins.precision import Precision
    from torch.utils.data import DataLoader, Dataset

    from lightning_solo.ddp.precision import SoloMixedPrecision

    torch.manual_seed(0)
    tf32 = args.precision == "32-tf32"  # strict fp32 otherwise: cuDNN allows TF32 unless told not to
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = torchvision.models.get_model(args.arch, num_classes=10)
            if args.channels_last:
                self.model.to(memory_format=torch.channels_last)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.start = self.end = 0.0

        def _now(self) -> float:
            if args.device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == args.warmup:
                self.start = self._now()
                if args.device == "cuda":  # the steady state's peak, not the autotuner's
                    torch.cuda.reset_peak_memory_stats()

        def on_train_end(self, trainer, pl_module):
            self.end = self._now()

    class SameBatch(Dataset):
        """One batch made on the device, handed out whole (batch_size=None: no collation, no copy)."""

        def __init__(self) -> None:
            size = (args.batch_size, 3, args.image_size, args.image_size)
            memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
            self.x = torch.randn(size, device=args.device).contiguous(memory_format=memory_format)
            self.y = torch.randint(0, 10, (args.batch_size,), device=args.device)

        def __len__(self) -> int:
            return args.warmup + args.steps

        def __getitem__(self, i):
            return self.x, self.y

    loader = DataLoader(SameBatch(), batch_size=None)
    plugin = Precision() if args.precision.startswith("32-") else SoloMixedPrecision(args.precision, args.device)
    clock, model = Clock(), Net()
    trainer = L.Trainer(
        accelerator=args.device,
        devices=1,
        benchmark=args.device == "cuda",  # cudnn autotuning
        plugins=[plugin],
        max_steps=args.warmup + args.steps,
        callbacks=[clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trainer.fit(model, loader)
    out = {
        "precision": args.precision,
        "imgs_per_s": args.batch_size * args.steps / (clock.end - clock.start),
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "train_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb) / 1024,
    }
    if args.device == "cuda":
        out["peak_mb"] = out["train_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument(
        "--precisions",
        default=None,
        help=f"comma list of {ALL_PRECISIONS} (default: all on cuda; no tf32 on cpu)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="optimizer steps not timed")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps timed")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--arch", default="resnet18", help="a torchvision classification model")
    p.add_argument("--json", help="also write the medians here, one entry per precision")
    p.add_argument("--threads", type=int, default=None, help="OMP threads per worker (default: all cores)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return

    precisions = (args.precisions or ",".join(ALL_PRECISIONS if args.device == "cuda" else CPU_DEFAULT)).split(",")
    bad = [x for x in precisions if x not in ALL_PRECISIONS]
    if bad:
        raise ValueError(f"unknown precision(s) {bad}; accepted: {ALL_PRECISIONS}")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    passthrough = [
        f"--device={args.device}",
        f"--warmup={args.warmup}",
        f"--steps={args.steps}",
        f"--batch-size={args.batch_size}",
        f"--image-size={args.image_size}",
        f"--arch={args.arch}",
        *(["--channels-last"] if args.channels_last else []),
    ]
    results: dict[str, list[dict]] = {x: [] for x in precisions}
    for r in range(args.rounds):
        order = precisions[r % len(precisions) :] + precisions[: r % len(precisions)]
        for prec in order:
            cmd = [sys.executable, __file__, "--worker", "--precision", prec, *passthrough]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"worker {prec} failed:\n{proc.stderr[-3000:]}")
            res = json.loads(line[len("RESULT ") :])
            results[prec].append(res)
            print(
                f"round {r} {prec:>10}: {res['imgs_per_s']:8.1f} img/s  peak {res['peak_mb']:8.1f} MB  "
                f"train {res['train_mb']:8.1f} MB",
                flush=True,
            )

    base = {k: statistics.median(x[k] for x in results[precisions[0]]) for k in ("imgs_per_s", "train_mb")}
    print(
        f"\n{args.arch}, {args.device}, batch {args.batch_size}, {args.image_size}x{args.image_size}, "
        f"channels_last={args.channels_last}, medians of {args.rounds} interleaved rounds "
        f"(ratios vs {precisions[0]}):"
    )
    print("| precision | img/s | speed vs fp32 | peak MB | train MB | train memory vs fp32 |")
    print("|---|---|---|---|---|---|")
    medians = {}
    for prec in precisions:
        med = medians[prec] = {
            k: statistics.median(x[k] for x in results[prec]) for k in ("imgs_per_s", "peak_mb", "train_mb")
        }
        print(
            f"| {prec} | {med['imgs_per_s']:.1f} | {med['imgs_per_s'] / base['imgs_per_s']:.2f}x | "
            f"{med['peak_mb']:.0f} | {med['train_mb']:.0f} | {med['train_mb'] / base['train_mb']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(medians, f)


if __name__ == "__main__":
    main()
