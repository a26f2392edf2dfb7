"""Does WarmupScaledLR keep accuracy when the global batch grows 4× and 8×? (Goyal et al. 2017, on CPU.)

Same data, same number of epochs (so a larger batch takes proportionally fewer steps), same model and
base lr; only the global batch and the lr policy change:

    base     global batch B,  the base lr (chosen by --sweep at B)
    (a)      4B / 8B, no scaling              WarmupScaledLR(rule="none", warmup_steps=0)
    (b)      4B / 8B, linear scaling           WarmupScaledLR(rule="linear", warmup_steps=0)
    (c)      4B / 8B, linear scaling + warmup  WarmupScaledLR(rule="linear", warmup_epochs=W)
    (c')     4B / 8B, linear scaling + the default warmup (5% of the run)

All runs use the callback's built-in cosine decay after warmup. A large global batch is simulated by one
process with a large per-device batch: the model uses GroupNorm, so one process × kB computes exactly
the gradient of k processes × B under DDP (no per-device BatchNorm statistics to tell them apart), and
the callback reads the global batch from the dataloader either way.

    python benchmarks/bench_lr_scaling.py --sweep 0.003125 0.00625 0.0125 0.025 --seeds 0   # base lr at B
    python benchmarks/bench_lr_scaling.py                    # B=16, lr 0.00625, 15 epochs, seeds 0 1 2
    python benchmarks/bench_lr_scaling.py --data digits --multiples 4 --epochs 10 --lr 0.025   # real images

``--data digits`` trains on the handwritten digits (1×8×8, the runner's default data, its fixed held-out split)
instead of the synthetic images.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo.app.data import DigitsDataModule, SyntheticImages
from lightning_solo.callbacks import WarmupScaledLR


def materialize(n: int, seed: int, offset: int, noise: float, size: int, classes: int) -> TensorDataset:
    ds = SyntheticImages(n, num_classes=classes, image_size=size, noise=noise, seed=seed, split_offset=offset)
    xs, ys = zip(*(ds[i] for i in range(n)))
    return TensorDataset(torch.stack(xs), torch.tensor(ys))


def digits() -> tuple[TensorDataset, TensorDataset]:
    dm = DigitsDataModule()
    dm.setup("fit")
    return dm.train_set, dm.val_set


def small_cnn(classes: int, width: int = 16, in_channels: int = 3) -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU()]

    return nn.Sequential(
        *block(in_channels, width),
        *block(width, width),
        nn.MaxPool2d(2),  # GroupNorm(8, ·): batch-independent
        *block(width, 2 * width),
        *block(2 * width, 2 * width),
        nn.MaxPool2d(2),
        *block(2 * width, 4 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, classes),
    )


class Classifier(L.LightningModule):
    def __init__(self, classes: int, lr: float, train: TensorDataset, batch: int) -> None:
        super().__init__()
        in_channels = train.tensors[0].shape[1]
        self.net, self.lr, self.train_set, self.batch = (
            small_cnn(classes, in_channels=in_channels),
            lr,
            train,
            batch,
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch, shuffle=True, drop_last=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)


@torch.no_grad()
def accuracy(net: nn.Module, data: TensorDataset) -> float:
    net.eval()
    x, y = data.tensors
    correct = sum((net(x[i : i + 1024]).argmax(1) == y[i : i + 1024]).sum().item() for i in range(0, len(y), 1024))
    return 100.0 * correct / len(y)


def train_once(args, train, val, batch: int, policy: dict, seed: int, lr: float) -> tuple[float, bool]:
    L.seed_everything(seed, workers=True, verbose=False)
    model = Classifier(args.classes, lr, train, batch)
    callback = WarmupScaledLR(reference_batch_size=args.base_batch, decay="cosine", log_lr=False, **policy)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(model)
    diverged = not all(torch.isfinite(p).all() for p in model.parameters())
    return (0.0 if diverged else accuracy(model.net, val)), diverged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", choices=("synthetic", "digits"), default="synthetic")
    parser.add_argument("--base-batch", type=int, default=16)
    parser.add_argument("--multiples", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--warmup-epochs", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.00625, help="base lr at the base global batch (--sweep)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-size", type=int, default=8192)
    parser.add_argument("--val-size", type=int, default=4096)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--noise", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--sweep",
        type=float,
        nargs="*",
        default=None,
        help="only train the base batch at these lrs (default grid if empty) and stop",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # the per-run decision lines
    os.environ.setdefault("PYTHONWARNINGS", "ignore")

    if args.data == "digits":
        train, val = digits()
        what = "handwritten digits, 1×8×8, 10 classes"
    else:
        train = materialize(args.train_size, 0, 0, args.noise, args.image_size, args.classes)
        val = materialize(args.val_size, 0, args.train_size, args.noise, args.image_size, args.classes)
        what = f"{args.classes} classes, 3×{args.image_size}×{args.image_size}, noise {args.noise}"
    print(
        f"data: {len(train)} train / {len(val)} val, {what}; {args.epochs} epochs; "
        f"base global batch {args.base_batch}; seeds {args.seeds}",
        flush=True,
    )

    if args.sweep is not None:
        for lr in args.sweep or [0.0125, 0.025, 0.05, 0.1, 0.2]:
            accs = [
                train_once(args, train, val, args.base_batch, dict(rule="none", warmup_steps=0), s, lr)[0]
                for s in args.seeds
            ]
            print(
                f"sweep  batch {args.base_batch:4d}  lr {lr:<7g} acc {statistics.median(accs):6.2f}  {accs}",
                flush=True,
            )
        return

    configs = [("base", args.base_batch, dict(rule="none", warmup_steps=0))]
    for k in args.multiples:
        batch = k * args.base_batch
        configs += [
            (f"{k}x (a) no scaling", batch, dict(rule="none", warmup_steps=0)),
            (f"{k}x (b) linear, no warmup", batch, dict(rule="linear", warmup_steps=0)),
            (f"{k}x (c) linear + warmup", batch, dict(rule="linear", warmup_epochs=args.warmup_epochs)),
            (f"{k}x (c') linear + 5% warmup", batch, dict(rule="linear")),  # the callback's default
        ]
    results: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    diverged: dict[str, int] = {name: 0 for name, _, _ in configs}
    t0 = time.perf_counter()
    for seed in args.seeds:  # seeds outermost: every config sees each seed before the next one starts
        for name, batch, policy in configs:
            acc, bad = train_once(args, train, val, batch, policy, seed, args.lr)
            results[name].append(acc)
            diverged[name] += bad
            print(
                f"seed {seed}  {name:<28} batch {batch:4d}  acc {acc:6.2f}{'  DIVERGED' if bad else ''}",
                flush=True,
            )

    base = statistics.median(results["base"])
    print(
        f"\nbase lr {args.lr} at global batch {args.base_batch}; warmup {args.warmup_epochs} epochs; "
        f"{len(args.seeds)} seeds; {time.perf_counter() - t0:.0f} s"
    )
    print(f"| {'config':<28} | global batch | lr after warmup | median acc | Δ vs base | per seed |")
    print(f"|{'-' * 30}|--------------|-----------------|------------|-----------|----------|")
    for name, batch, policy in configs:
        med = statistics.median(results[name])
        scale = batch / args.base_batch if policy["rule"] == "linear" else 1.0
        seeds = " ".join(f"{a:.2f}" for a in results[name]) + (
            f" ({diverged[name]} diverged)" if diverged[name] else ""
        )
        print(f"| {name:<28} | {batch:12d} | {args.lr * scale:15g} | {med:10.2f} | {med - base:+9.2f} | {seeds} |")


if __name__ == "__main__":
    main()
