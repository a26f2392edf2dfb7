"""A 2-process CPU fit (popen launcher) stopped by SIGTERM at the end of training batch BATCH, then resumed.

    python tests/scripts/sigterm_fit.py MODE BATCH OUT_DIR

MODE:

* ``one``: rank 1 alone sends itself SIGTERM, as a preempted node's process gets it;
* ``alone``: the same fit on one process (``devices=1``), which sends itself SIGTERM;
* ``group``: every process of the job gets it, both ranks and their loader workers, as SLURM signals every
  process of a job step: a helper outside the job signals the process group this script leads (start it in a
  session of its own);
* ``resume``: ``fit(ckpt_path="auto")`` from what the stopped fit left in OUT_DIR/ckpt, to the end;
* ``full``: the same fit, never stopped (the reference for the resumed one).
MODE may name several, joined by ``+`` (``resume+full``): their fits run in turn in the same processes.

SoloDDP's defaults with WarmupScaledLR, SoloCheckpoint (every 2 steps, and on the exception), accumulation 2,
two loader workers per loader with random augmentation, and validation inside the epoch. Each rank writes
OUT_DIR/rank<k>.<MODE>.batch<BATCH>.json: how its fit ended (the exception's type, the global step and the batch
it stopped at), ``trainer.received_sigterm`` just after the signal and at the end, the step the fit started at and
the checkpoint it resumed from, the strategy's SIGTERM decisions; and OUT_DIR/rank<k>.<MODE>.pt, its weights.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from user_model import QUIET, Jittered, Validated, mlp

from lightning_solo import SoloDDP
from lightning_solo.callbacks import SoloCheckpoint, WarmupScaledLR

SIGTERM_DECISIONS = ("sigterm_check", "sigterm_checkpoint")


class SigtermAt(L.Callback):
    def __init__(self, mode: str, batch: int) -> None:
        self.mode, self.batch, self.record = mode, batch, {"ended": "normally"}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.record["last_batch"] = trainer.fit_loop.epoch_loop.total_batch_idx
        if self.record["last_batch"] != self.batch:
            return
        if (self.mode, trainer.global_rank) in (("one", 1), ("alone", 0)):
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.mode == "group" and trainer.global_rank == 0:
            group = os.getpgid(0)
            assert group == os.getpid(), "start this script in a session of its own: it signals its group"
            # From outside the job, as SLURM's: a worker takes a SIGTERM from its own rank as an order to end.
            kill = f"import os, signal; os.killpg({group}, signal.SIGTERM)"
            subprocess.run([sys.executable, "-c", kill], start_new_session=True, check=True)
        else:
            return
        self.record["received_at_signal"] = trainer.received_sigterm  # the handler has run by now

    def on_exception(self, trainer, pl_module, exception):
        self.record["ended"] = type(exception).__name__


def main(mode: str, batch: int, out: Path) -> None:
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))  # 16 batches per rank
    watch = SigtermAt(mode, batch)
    ckpt = out / ("ckpt_full" if mode == "full" else "ckpt")
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if mode == "alone" else 2, strategy=SoloDDP(), max_epochs=1, accumulate_grad_batches=2,
        val_check_interval=4, limit_val_batches=2, num_sanity_val_steps=0,
        callbacks=[
            WarmupScaledLR(reference_batch_size=32, warmup_steps=2, log_lr=False),
            SoloCheckpoint(dirpath=ckpt, every_n_train_steps=2, keep_last_k=1, save_on_exception=True),
            watch,
        ],
        default_root_dir=out, **QUIET,
    )  # fmt: skip
    loaders = [
        DataLoader(d, batch_size=8, shuffle=s, num_workers=2, persistent_workers=True)
        for d, s in ((Jittered(data), True), (data, False))
    ]
    model = Validated(mlp(), lr=0.05)
    try:
        trainer.fit(model, *loaders, ckpt_path="auto" if mode == "resume" else None)
    finally:
        record = {
            **watch.record,
            "global_step": trainer.global_step,
            "start_step": getattr(model, "start_step", None),
            "ckpt_path": trainer.ckpt_path,
            "received_sigterm": trainer.received_sigterm,
            "decisions": {k: d.as_dict() for k in SIGTERM_DECISIONS if (d := trainer.strategy.decisions.get(k))},
            # After teardown the trainer has Lightning's own check, notifier and stops back, the loaders their own
            # worker_init_fn.
            "given_back": not {"_broadcast_sigterm_tensor", "_sigterm_notifier_fn", "on_advance_end"}
            & {*vars(trainer.fit_loop.epoch_loop), *vars(trainer._signal_connector), *vars(trainer.fit_loop)}
            and all(loader.worker_init_fn is None for loader in loaders),
        }
        rank = trainer.global_rank
        (out / f"rank{rank}.{mode}.batch{batch}.json").write_text(json.dumps(record))
        torch.save(model.state_dict(), out / f"rank{rank}.{mode}.pt")


if __name__ == "__main__":
    for each in sys.argv[1].split("+"):
        main(each, int(sys.argv[2]), Path(sys.argv[3]))
