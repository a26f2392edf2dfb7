"""Step-time overhead of SoloSyncBatchNorm against plain BatchNorm, 2 CPU processes over gloo, with SyncBN's
collectives on the world group (what SoloDDP does on gloo) and on a gloo group of their own (what it does on
NCCL, with an NCCL group).

The variants are DDP-wrapped copies of the same model in the same process group. Steps alternate
A, B, C, A, B, C, ... so that load on the machine hits all alike; after warm-up the median step time of each
is taken per round, and the figures are the medians over rounds of the per-round ratios to plain BatchNorm.

    python benchmarks/bench_syncbn.py                      # resnet18 (32x32) and a BN-heavy small net
    python benchmarks/bench_syncbn.py --rounds 5 --steps 10 --batch 16
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import nn

from lightning_solo.ddp import syncbn
from lightning_solo.testing import run_ranks


def small_net() -> nn.Module:
    """Little compute per BN layer: the case where synchronising costs the most, relatively."""
    layers, channels = [], 3
    for out in (16, 16, 32, 32, 64, 64):
        layers += [nn.Conv2d(channels, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


MODELS = {
    "resnet18": lambda: torchvision.models.get_model("resnet18", num_classes=10),
    "small_bn_net": small_net,
}


def _step(ddp, opt, x, y) -> float:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(ddp(x), y).backward()
    opt.step()
    return time.perf_counter() - start


VARIANTS = ("plain", "synced", "synced_own_group")


def _rank(rank: int, world: int, args) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    torch.manual_seed(0)
    own_group = dist.new_group(backend="gloo")
    results = {}
    for name in args.models:
        base = MODELS[name]()
        variants = {
            "plain": copy.deepcopy(base),
            "synced": syncbn.convert(copy.deepcopy(base)),
            "synced_own_group": syncbn.convert(copy.deepcopy(base), process_group=own_group),
        }
        runs = {}
        for key, model in variants.items():
            ddp = nn.parallel.DistributedDataParallel(model)
            runs[key] = (ddp, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        x = torch.randn(args.batch, 3, args.size, args.size)
        y = torch.randint(0, 10, (args.batch,))
        for key in runs:  # warm-up
            for _ in range(2):
                _step(*runs[key], x, y)
        medians: dict[str, list[float]] = {key: [] for key in VARIANTS}
        ratios: dict[str, list[float]] = {key: [] for key in VARIANTS[1:]}
        for _ in range(args.rounds):
            times: dict[str, list[float]] = {key: [] for key in VARIANTS}
            for _ in range(args.steps):
                for key in VARIANTS:
                    times[key].append(_step(*runs[key], x, y))
            round_medians = {k: statistics.median(v) for k, v in times.items()}
            for key, value in round_medians.items():
                medians[key].append(value)
            for key in ratios:
                ratios[key].append(round_medians[key] / round_medians["plain"])
        results[name] = dict(
            ms={key: 1e3 * statistics.median(v) for key, v in medians.items()},
            ratio={key: (statistics.median(v), min(v), max(v)) for key, v in ratios.items()},
            bn_layers=sum(isinstance(m, nn.BatchNorm2d) for m in base.modules()),
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=16, help="per-process batch")
    parser.add_argument("--size", type=int, default=32, help="image side")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps of each variant per round")
    args = parser.parse_args()

    results = run_ranks(_rank, 2, args, timeout=1800)[0]

    print(f"2 CPU processes (gloo), per-process batch {args.batch}, {args.size}x{args.size} inputs, "
          f"{args.rounds} rounds x {args.steps} interleaved steps; ratio to plain BN (min-max over rounds)")  # fmt: skip
    print(f"{'model':<14}{'BN layers':>10}{'plain ms':>10}{'synced (world group)':>32}{'synced (own group)':>32}")
    for name, r in results.items():
        cells = [
            f"{r['ms'][key]:7.1f} ms {r['ratio'][key][0]:5.3f} ({r['ratio'][key][1]:.3f}-{r['ratio'][key][2]:.3f})"
            for key in VARIANTS[1:]
        ]
        print(f"{name:<14}{r['bn_layers']:>10}{r['ms']['plain']:>10.1f}{cells[0]:>32}{cells[1]:>32}")


if __name__ == "__main__":
    main()
