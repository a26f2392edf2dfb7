"""Uneven data (:mod:`lightning_solo.ddp.uneven`): what stock ``DDPStrategy`` does on two gloo ranks whose
``IterableDataset`` shards hold 10 and 13 training batches (validation 4 and 6, 2 epochs), against ``SoloDDP()``;
and what the per-batch agreement costs on even data (interleaved A/B rounds, medians): through Lightning, and in
a raw torch loop (2 gloo ranks, a step of 3 matmuls and DDP's gradient all-reduce) where the per-batch cost shows,
beside what the SIGTERM agreement's per-batch flag costs there.

Usage::

    python -m benchmarks.uneven_check --rounds 5     # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from datetime import timedelta
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, IterableDataset

from lightning_solo import SoloDDP
from lightning_solo.ddp.agreed_end import AgreedEnd
from lightning_solo.ddp.agreement import Agreement
from lightning_solo.testing import run_ranks

BATCH = 32


class Shard(IterableDataset):
    def __init__(self, rank: int, batches: int, seed: int) -> None:
        self.rank, self.batches, self.seed = rank, batches, seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.rank)
        n = self.batches * BATCH
        return iter(zip(torch.randn(n, 64, generator=g), torch.randn(n, 1, generator=g)))


class Net(L.LightningModule):
    def __init__(self, train: tuple[int, int], val: tuple[int, int], out: str) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
        self.train_batches, self.val_batches, self.out = train, val, out
        self.step_ms: list[float] = []
        self._last = 0.0

    def _loader(self, batches: tuple[int, int], seed: int) -> DataLoader:
        rank = self.trainer.global_rank
        return DataLoader(Shard(rank, batches[rank], seed), batch_size=BATCH)

    def train_dataloader(self):
        return self._loader(self.train_batches, 100)

    def val_dataloader(self):
        return self._loader(self.val_batches, 200)

    def on_train_batch_start(self, batch, batch_idx):
        now = time.perf_counter()
        if batch_idx > 5:  # past the first batches (and the first of each epoch: its one wait)
            self.step_ms.append((now - self._last) * 1e3)
        self._last = now

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y), on_step=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_fit_end(self):
        if self.trainer.global_rank == 0:
            torch.save(self.step_ms, self.out)


def fit(strategy, train, val, epochs: int, out: str) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Net(train, val, out))


def outcomes(out: str) -> None:
    print("| strategy (2 gloo ranks, train 10/13 batches, val 4/6, 2 epochs) | outcome | wall s |")
    print("|---|---|---|")
    contenders = {
        "DDPStrategy(timeout=10 s)": lambda: DDPStrategy(start_method="fork", timeout=timedelta(seconds=10)),
        "SoloDDP(uneven_data=False, timeout=10 s)": lambda: SoloDDP(
            start_method="fork", uneven_data=False, timeout=timedelta(seconds=10)
        ),
        "SoloDDP()": lambda: SoloDDP(start_method="fork"),
    }
    for name, make in contenders.items():
        start = time.perf_counter()
        try:
            fit(make(), (10, 13), (4, 6), 2, out)
            outcome = "finished: every rank 10 batches an epoch, validation 4"
        except Exception as err:  # noqa: BLE001 - the outcome is what is measured
            last = traceback.format_exception_only(err)[-1].strip().splitlines()[-1]
            outcome = f"failed: {last[:160]}"
        print(f"| {name} | {outcome} | {time.perf_counter() - start:.1f} |")


def overhead(out: str, rounds: int, batches: int) -> None:
    contenders = {"SoloDDP()": {}, "SoloDDP(uneven_data=False)": {"uneven_data": False}}
    medians: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            fit(SoloDDP(start_method="fork", **contenders[name]), (batches, batches), (0, 0), 1, out)
            medians[name].append(statistics.median(torch.load(out)))
    a, b = medians["SoloDDP()"], medians["SoloDDP(uneven_data=False)"]
    ratios = [x / y for x, y in zip(a, b)]
    print(f"\neven data, {batches} batches of {BATCH} per rank, {rounds} rounds (order alternated), median step ms:")
    print("| contender | ms/step (median of rounds; range) |")
    print("|---|---|")
    for name, values in medians.items():
        print(f"| {name} | {statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f}) |")
    print(f"| ratio SoloDDP() / uneven_data=False, per round | {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}–{max(ratios):.3f}) |")  # fmt: skip


def _raw_loop(rank: int, world: int, steps: int, rounds: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    group = dist.new_group(backend="gloo")  # the side group's kind
    x, w, grad = torch.randn(256, 256), torch.randn(256, 256), torch.randn(300_000)

    def run(name: str) -> float:
        batches: Any = iter(range(steps))
        flag = Agreement(group) if name == "plain + a SIGTERM-style flag per batch" else None
        if name == "AgreedEnd":
            batches = AgreedEnd(batches, group)
        start = time.perf_counter()
        for _ in batches:
            if flag is not None:
                flag.check(False)
            for _ in range(3):
                x @ w
            dist.all_reduce(grad)  # DDP's gradient all-reduce
        if flag is not None:
            flag.settle()
        return (time.perf_counter() - start) / steps * 1e3

    names = ["plain iterator", "AgreedEnd", "plain + a SIGTERM-style flag per batch"]
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % 3 :] + names[: r % 3]:  # rotated each round
            times[name].append(run(name))
    return times


def raw(rounds: int, steps: int) -> None:
    times = run_ranks(_raw_loop, 2, steps, rounds, timeout=600)[0]
    base = times["plain iterator"]
    print(f"\nraw torch loop, 2 gloo ranks, {steps} steps x {rounds} rounds (order rotated), rank 0:")
    print("| iterator | ms/step (median; range) | vs plain, per round (median; range) |")
    print("|---|---|---|")
    for name, values in times.items():
        ratios = [v / b for v, b in zip(values, base)]
        print(f"| {name} | {statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f}) | "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--out", default="/tmp/uneven_check_steps.pt")
    args = parser.parse_args(argv)
    outcomes(args.out)
    overhead(args.out, args.rounds, args.batches)
    raw(args.rounds * 2 - 1, 300)


if __name__ == "__main__":
    main()
