"""A 2-process CPU fit (popen launcher, SoloDDP's defaults but small watchdog thresholds) in which one rank stalls
at step STEP, as MODE says:

    python tests/scripts/hang_fit.py MODE OUT_DIR [TIMEOUT_S]

* ``sleep``: rank 1 sleeps forever in ``training_step``;
* ``slow_exit``: as ``sleep``, and rank 0 (which started rank 1) takes 6 s to exit, as a rank may on a loaded
  machine: longer than Lightning's process observer (in rank 0) waits between its looks at rank 1;
* ``loader``: rank 1's loader worker (``num_workers=1``) sleeps forever in ``__getitem__``;
* ``extra``: rank 1 issues one collective the other does not (``strategy.all_gather`` on a gloo group named
  "extra", made by both at setup, in ``training_step``): the flight recorder sees it (a monitored barrier's
  point-to-point messages it does not record);
* ``checkpoint``: rank 0's checkpoint write stalls halfway (pickling an object that never returns);
* ``kill``: rank 1 sends itself SIGKILL in ``training_step``;
* ``uneven``: rank 1's loader holds 8 batches, rank 0's 16 (map-style, no distributed sampler, no checkpoints),
  with ``uneven_data=False`` (the policy, which would end both at 8, off: a case it cannot settle): rank 1 finishes
  its fit and goes on with other work while rank 0 waits in its ninth step's all-reduce (stock waits the timeout);
* ``none``: nothing stalls (the watchdog must stay quiet);
* ``stock``: stock ``DDPStrategy(timeout=8 s)``, rank 1 sleeps 12 s in ``training_step`` (the contrast);
* ``healthy`` (SoloDDP) and ``healthy_stock`` (``DDPStrategy()``): a run that finishes, 4 epochs with a
  validation and a checkpoint each, in which a rank works SLOW_S (2 x the margin) in one place, 8 times:
  rank 0 behind ``is_global_zero`` in ``on_train_epoch_end`` (epoch 1), ``on_validation_epoch_end`` (epoch 1)
  and ``on_train_end``; rank 0's first checkpoint write; both ranks' evaluation at epoch 2; rank 1's loader
  worker, re-spawned each epoch, in ``worker_init_fn`` (epoch 3); rank 1 in one ``training_step`` (step
  SLOW_STEP) and in a C call holding the interpreter lock (step GIL_STEP). Rank 0 saves the weights to
  OUT_DIR/weights.pt.

``STOCK=1`` in the environment: any fault under stock ``DDPStrategy(timeout=8 s)`` (the contrast).
TIMEOUT_S: ``SoloDDP(timeout=...)`` (default 30 minutes), at which a reported stall ends the run. ``DEFAULTS=1`` in
the environment: the watchdog's default thresholds, with SLOW_S 70 s; ``EVENTS=a,b``: only those slow places
(``epoch_end``, ``val_epoch_end``, ``train_end``, ``checkpoint``, ``evaluation``, ``workers``, ``step``, ``gil``).

The stalling rank writes OUT_DIR/stall.json (its rank, the time the stall began) just before it stalls; rank 0
writes OUT_DIR/end.json when its fit returns or raises (the exception's type and message).
"""

import ctypes
import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset
from user_model import QUIET, Tiny

from lightning_solo import SoloDDP

STEP = 6
DEFAULTS = os.environ.get("DEFAULTS") == "1"
# The defaults scaled down together with the slow work (margin 55 s -> 3 s, silent 120 s -> 6 s, work 60-120 s -> 6 s).
WATCHDOG = (
    True if DEFAULTS else
    {"factor": 2.0, "margin_s": 3.0, "first_s": 30.0, "interval_s": 0.25, "grace_s": 5.0, "silent_s": 6.0}
)  # fmt: skip
SLOW_S = 70.0 if DEFAULTS else 6.0
faulthandler.register(signal.SIGQUIT, all_threads=True)  # a run the test gave up on prints its stacks (hang_runs)
SLOW_STEP, GIL_STEP = 20, 56  # in epochs 1 and 3 (16 batches an epoch)
ALL = ("epoch_end", "val_epoch_end", "train_end", "checkpoint", "evaluation", "workers", "step", "gil")
EVENTS = set(os.environ.get("EVENTS", ",".join(ALL)).split(","))


def stall_marker(out: Path, rank: int) -> None:
    (out / "stall.json").write_text(json.dumps({"rank": rank, "t": time.time()}))


class Data(Dataset):
    def __init__(self, out: Path, stall: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(512, 8, generator=g), torch.randint(0, 2, (512,), generator=g)
        self.out, self.stall, self.rank, self.calls = out, stall, -1, 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        # In rank 1's one worker: the first sample of batch STEP + 2 (the worker and Lightning fetch ahead).
        self.calls += 1
        if self.stall and self.rank == 1 and self.calls == 4 * (STEP + 2) + 1:
            stall_marker(self.out, 1)
            time.sleep(3600)
        return self.x[i], self.y[i]


class NeverPickled:
    """A checkpoint entry whose write never ends, as a write to a stalled file system."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def __reduce__(self):
        stall_marker(self.out, 0)
        time.sleep(3600)
        return (NeverPickled, (self.out,))


class Stalling(Tiny):
    def __init__(self, mode: str, out: Path, data: Data) -> None:
        super().__init__()
        self.mode, self.out, self.data = mode, out, data

    def setup(self, stage: str) -> None:
        if self.mode == "slow_exit" and self.global_rank == 0:
            exit_now = os._exit
            os._exit = lambda status: (time.sleep(6), exit_now(status))  # the watchdog ends the rank with it
        if self.mode == "extra":  # every rank makes it; only rank 1 will use it
            self.extra = torch.distributed.new_group(backend="gloo", group_desc="extra")

    def train_dataloader(self):
        self.data.rank = self.global_rank  # the worker is forked with it
        if self.mode == "uneven":  # rank 1's own 8 batches, rank 0's 16 (no distributed sampler)
            data = torch.utils.data.Subset(self.data, range(32 if self.global_rank else 64))
            return DataLoader(data, batch_size=4)
        return DataLoader(self.data, batch_size=4, num_workers=1 if self.mode == "loader" else 0)

    def training_step(self, batch, batch_idx):
        time.sleep(0.01)  # a 10-15 ms step
        if self.mode == "uneven" and self.global_rank == 1 and batch_idx == 7:
            stall_marker(self.out, 0)  # rank 0 will wait in its next step's all-reduce
        if self.global_rank == 1 and self.global_step == STEP:
            if self.mode in ("sleep", "slow_exit", "stock"):
                stall_marker(self.out, 1)
                time.sleep(12 if self.mode == "stock" else 3600)
            elif self.mode == "extra" and batch_idx == STEP:
                stall_marker(self.out, 1)
                self.trainer.strategy.all_gather(torch.ones(1), group=self.extra)
            elif self.mode == "kill":
                stall_marker(self.out, 1)
                os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)

    def on_save_checkpoint(self, checkpoint):
        if self.mode == "checkpoint" and self.global_rank == 0 and self.global_step == STEP:
            checkpoint["stall"] = NeverPickled(self.out)


class SlowWorkers(Dataset):
    """128 samples; ``epoch`` is set by the model before each epoch's workers fork."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(n)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g)
        self.epoch, self.rank = 0, -1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def slow_worker_init(worker_id: int) -> None:
    data = torch.utils.data.get_worker_info().dataset
    if data.rank == 1 and data.epoch == 3 and "workers" in EVENTS:
        time.sleep(SLOW_S)


class SlowPickle:
    """A checkpoint entry whose write takes SLOW_S, as a first write to a slow file system."""

    def __reduce__(self):
        time.sleep(SLOW_S)
        return (int, (0,))


class Healthy(Tiny):
    """Slow in one place at a time, never hung (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.train_data, self.val_data, self.saves = SlowWorkers(256), SlowWorkers(64), 0

    def train_dataloader(self):
        self.train_data.rank = self.global_rank
        return DataLoader(self.train_data, batch_size=8, num_workers=1, worker_init_fn=slow_worker_init)

    def val_dataloader(self):
        return DataLoader(self.val_data, batch_size=8)

    def training_step(self, batch, batch_idx):
        time.sleep(0.01)
        if self.global_rank == 1 and self.global_step == SLOW_STEP and "step" in EVENTS:
            time.sleep(SLOW_S)  # a recompile
        if self.global_rank == 1 and self.global_step == GIL_STEP and "gil" in EVENTS:
            ctypes.PyDLL(None).sleep(int(SLOW_S))  # libc's sleep, the interpreter lock held
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self.current_epoch == 2 and batch_idx == 0 and "evaluation" in EVENTS:
            time.sleep(SLOW_S)
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def on_validation_epoch_end(self):
        if self.trainer.is_global_zero and self.current_epoch == 1 and "val_epoch_end" in EVENTS:
            time.sleep(SLOW_S)

    def on_train_epoch_end(self):
        self.train_data.epoch = self.current_epoch + 1  # the next epoch's worker forks with it
        if self.trainer.is_global_zero and self.current_epoch == 1 and "epoch_end" in EVENTS:
            time.sleep(SLOW_S)

    def on_train_end(self):
        if self.trainer.is_global_zero and "train_end" in EVENTS:
            time.sleep(SLOW_S)

    def on_save_checkpoint(self, checkpoint):
        self.saves += 1
        if self.global_rank == 0 and self.saves == 1 and "checkpoint" in EVENTS:
            checkpoint["slow"] = SlowPickle()


def healthy(mode: str, out: Path) -> None:
    L.seed_everything(0, verbose=False)
    strategy = DDPStrategy() if mode == "healthy_stock" else SoloDDP(watchdog=WATCHDOG)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=4, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=out / "ckpt", filename="{epoch}", save_top_k=-1)],
        default_root_dir=out, **QUIET,
    )  # fmt: skip
    model = Healthy()
    trainer.fit(model)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), out / "weights.pt")
        (out / "end.json").write_text(json.dumps({"ended": "normally", "t": time.time()}))


def main(mode: str, out: Path, timeout_s: float | None = None) -> None:
    if mode.startswith("healthy"):
        return healthy(mode, out)
    L.seed_everything(0, verbose=False)
    timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    strategy = (
        DDPStrategy(timeout=timedelta(seconds=8))
        if mode == "stock" or os.environ.get("STOCK") == "1"
        else SoloDDP(watchdog=WATCHDOG, uneven_data=mode != "uneven" and "shortest", **timeout)
    )
    uneven = {"max_epochs": 1, "enable_checkpointing": False, "use_distributed_sampler": False}
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, num_sanity_val_steps=0, default_root_dir=out,
        **(uneven if mode == "uneven" else {"max_steps": 12, "callbacks": [ModelCheckpoint(
            dirpath=out / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)]}),
        **QUIET,
    )  # fmt: skip
    model = Stalling(mode, out, Data(out, stall=mode == "loader"))
    end = {"ended": "normally"}
    try:
        trainer.fit(model)
        if mode == "uneven" and trainer.global_rank == 1:
            time.sleep(120)  # the script goes on after its fit (its process alive, in no collective)
    except BaseException as err:
        end = {"ended": type(err).__name__, "message": str(err)[:2000]}
        raise
    finally:
        if trainer.global_rank == 0:
            (out / "end.json").write_text(json.dumps({**end, "t": time.time()}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else None)
