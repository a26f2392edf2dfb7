"""Cost of SoloDDP's hang watchdog on a 10-15 ms CPU step: 2 gloo processes x 1 thread, an MLP sized to that step,
fits with ``watchdog=True`` (the default: a heartbeat every second on a daemon thread, ranks 0 and 1 judging) and
``watchdog=False`` interleaved round by round (the order alternating), rank 0's median step time per fit. Figures:
the median over rounds of the (on / off) ratios of the step time and of the CPU time per step, and the training
thread's own cost per step (the phase transitions SoloDDP's hooks make: one batch start, three phases entered and
left), timed in-process.

    python benchmarks/bench_watchdog.py                    # ~2-3 minutes on 2 idle cores
    python benchmarks/bench_watchdog.py --rounds 8 --steps 200 --hidden 384
    python benchmarks/bench_watchdog.py --costs-only       # seconds: the two costs, no fits
    python benchmarks/bench_watchdog.py --same-processes --rounds 12   # every fit in one long-lived pair of ranks

Each fit also reports the CPU time both processes spent per step (every thread: training, watchdog, gloo), the
resource the watchdog's work takes; it moves less with scheduling than the step's wall time does.

``--same-processes``: the fits run in turn in one pair of gloo processes started once (Lightning joins their process
group, as under torchrun), so that the fresh processes' own variance (placement, allocator, loopback sockets) is
not part of the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.stats import median_interval
from lightning_solo import SoloDDP
from lightning_solo.ddp.watchdog import HeartbeatWriter, Watchdog, WatchdogSettings, judge
from lightning_solo.ddp.watchdog import heartbeat as hb
from lightning_solo.testing import run_ranks


class MLP(L.LightningModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, 10),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepTimer(L.Callback):
    """Rank 0's step times, and the CPU time both processes spent per step (every thread: the training thread,
    the watchdog's, gloo's), from the 11th step on."""

    def __init__(self, out: Path) -> None:
        self.out, self.starts, self.cpu = out, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())
        if len(self.starts) == 11:
            self.cpu = time.process_time()

    def on_train_end(self, trainer, pl_module):
        steps = len(self.starts) - 11
        cpu = trainer.strategy.reduce(torch.tensor((time.process_time() - self.cpu) / steps), reduce_op="sum")
        if trainer.is_global_zero:
            times = [b - a for a, b in zip(self.starts, self.starts[1:])]
            self.out.write_text(json.dumps({"times": times, "cpu": float(cpu)}))


def fit(watchdog: bool, steps: int, hidden: int, batch: int, start_method: str | None = "fork") -> tuple[float, float]:
    """Rank 0's median step (s) of one fit, and both processes' CPU time per step (s); ``start_method=None``: the
    ranks are already running (this process is one of them, in an initialised process group)."""
    out = Path(tempfile.mkdtemp()) / "times.json"
    data = TensorDataset(torch.randn(2 * batch * (steps + 1), 256), torch.randint(0, 10, (2 * batch * (steps + 1),)))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=steps,
        strategy=SoloDDP(start_method=start_method or "auto", watchdog=watchdog),
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[StepTimer(out)], default_root_dir=out.parent,
    )  # fmt: skip
    trainer.fit(MLP(hidden), DataLoader(data, batch_size=batch))
    if not trainer.is_global_zero:
        return float("nan"), float("nan")
    measured = json.loads(out.read_text())
    return statistics.median(measured["times"][10:]), measured["cpu"]  # the first steps warm up


def _same_processes(rank: int, world_size: int, rounds: int, steps: int, hidden: int, batch: int) -> dict:
    """One rank of the long-lived pair: every round's two fits, in the same order on both ranks."""
    os.environ["LOCAL_RANK"] = str(rank)  # the ranks are running already (as under torchrun)
    medians: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(rounds):
        for watchdog in (True, False) if r % 2 == 0 else (False, True):
            medians[watchdog].append(fit(watchdog, steps, hidden, batch, start_method=None))
        if rank == 0 and (r + 1) % 10 == 0:  # a long run says how far it is
            on, off = (statistics.median(f[0] for f in medians[w]) for w in (True, False))
            print(f"[bench_watchdog] {r + 1}/{rounds} rounds; median step so far on {1000 * on:.2f} / off "
                  f"{1000 * off:.2f} ms", file=sys.stderr, flush=True)  # fmt: skip
    return medians


def hook_cost_us() -> float:
    """The training thread's watchdog work per step, as SoloDDP's hooks do it."""
    writer = HeartbeatWriter()

    def step() -> None:
        writer.batch(6)
        outer_opt = writer.enter(hb.OPTIMIZER_STEP)
        outer = writer.enter(hb.TRAINING_STEP)
        writer.leave(outer)
        outer = writer.enter(hb.BACKWARD)
        writer.leave(outer)
        writer.leave(outer_opt, stepped=True)

    return 1e6 * min(timeit.repeat(step, number=10_000, repeat=5)) / 10_000


def beat_cost_ms(world_size: int = 2) -> float:
    """The watchdog thread's work per heartbeat on a judging rank (write its own, read and judge every rank's),
    on a real TCPStore of this process: once per ``interval_s`` (1 s)."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dogs = [Watchdog(WatchdogSettings(), torch.distributed.PrefixStore("b/", store), r, world_size, "unused")
            for r in range(world_size)]  # fmt: skip
    for dog in dogs:
        dog._publish()

    def beat() -> None:
        dogs[0]._publish()
        store.check(["b/verdict"])
        judge(dogs[0]._views(), dogs[0].settings.silent_s)

    return 1e3 * min(timeit.repeat(beat, number=200, repeat=5)) / 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--costs-only", action="store_true", help="only the per-step and per-beat costs")
    parser.add_argument("--same-processes", action="store_true", help="every fit in one long-lived pair of ranks")
    args = parser.parse_args()
    cost, beat = hook_cost_us(), beat_cost_ms()
    print(f"training-thread work per step: {cost:.2f} us = {cost / 1e4:.3%} of a 10 ms step")
    print(f"watchdog thread per heartbeat (judging rank, 2 ranks): {beat:.3f} ms, once a second = {beat / 1e3:.3%}")
    if args.costs_only:
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fits: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    if args.same_processes:
        fits = run_ranks(
            _same_processes,
            2,
            args.rounds,
            args.steps,
            args.hidden,
            args.batch,
            timeout=60 * args.rounds + 120,
        )[0]
    else:
        for r in range(args.rounds):
            for watchdog in (True, False) if r % 2 == 0 else (False, True):
                fits[watchdog].append(fit(watchdog, args.steps, args.hidden, args.batch))
    where = "one long-lived pair of processes" if args.same_processes else "fresh fork-launched ranks per fit"
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds x {args.steps} steps; hidden {args.hidden}; "
          f"{where}")  # fmt: skip
    for r, ((on, on_cpu), (off, off_cpu)) in enumerate(zip(fits[True], fits[False])):
        print(f"round {r}: step on {1000 * on:.2f} / off {1000 * off:.2f} ms; CPU per step (both processes) "
              f"on {1000 * on_cpu:.2f} / off {1000 * off_cpu:.2f} ms", flush=True)  # fmt: skip
    for what, i in (("median step (rank 0)", 0), ("CPU time per step (both processes, every thread)", 1)):
        on = [f[i] for f in fits[True]]
        off = [f[i] for f in fits[False]]
        ratios = [a / b for a, b in zip(on, off)]
        low, high = median_interval(ratios)
        print(f"{what}: on {1000 * statistics.median(on):.2f} ms, off {1000 * statistics.median(off):.2f} ms; "
              f"ratio on/off, median over rounds {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}; 95 % bootstrap interval {low:.3f}-{high:.3f})")  # fmt: skip
    off_step = statistics.median(f[0] for f in fits[False])
    print(f"training-thread work per step = {cost / (1e6 * off_step):.3%} of the off step")


if __name__ == "__main__":
    main()
