"""A tiny fit as one task of a SLURM job (the test sets SLURM's variables and puts a stub ``scontrol`` on PATH).

    SLURM_PROCID=0 ... python tests/scripts/slurm_fit.py OUT_DIR MAX_STEPS

``SLOW_STEPS=1``: 0.3 s per step, so that the test can signal mid-run. ``ASYNC_CKPT=1``: SoloCheckpoint every 2
steps into OUT_DIR/ckpt, written in the background, each background write 3 s; ``REQUEUE_SIGNAL``: SlurmRequeue's signal. ``SUBMITIT_EXECUTOR=slurm``: submitit's
signal handler is installed first, as in a job of hydra's submitit launcher. Each rank writes OUT_DIR/progress<k>
once past step 3, OUT_DIR/seen<k>.json (who owns the signal) then, and OUT_DIR/end<k>.json at the end of fit;
``fit(ckpt_path=None)`` resumes from Lightning's newest ``hpc_ckpt`` on SLURM.
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo import SoloDDP
from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.callbacks import SlurmRequeue, SoloCheckpoint
from lightning_solo.checkpoint import SoloCheckpointIO


class SlowIO(SoloCheckpointIO):
    def write_file(self, checkpoint, path, manifest):
        if threading.current_thread() is not threading.main_thread():  # a background write; the stop's own is not
            time.sleep(3.0)
        super().write_file(checkpoint, path, manifest)


class Task:
    """What hydra's submitit launcher submits: a callable whose ``checkpoint`` resubmits it."""

    def __call__(self):
        return None

    def checkpoint(self):
        from submitit.core.utils import DelayedSubmission

        return DelayedSubmission(self)


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        if os.environ.get("SLOW_STEPS"):
            time.sleep(0.3)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(L.Callback):
    def __init__(self, out: Path, requeue: SlurmRequeue):
        self.out, self.requeue = out, requeue

    def on_train_start(self, trainer, pl_module):
        self.start = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rank = trainer.global_rank
        if trainer.global_step == self.start + 3:
            signum = signal.SIGUSR1
            seen = {
                "start": self.start,
                "lightning_owns": lightning_compat.lightning_owns_requeue_signal(trainer, signum),
                "handler": getattr(signal.getsignal(signum), "__qualname__", None),
                "decisions": {k: d.value for k, d in self.requeue.decisions.items()},
            }
            (self.out / f"seen{rank}.json").write_text(json.dumps(seen))
            (self.out / f"progress{rank}").touch()

    def on_train_end(self, trainer, pl_module):
        (self.out / f"end{trainer.global_rank}.json").write_text(json.dumps({"global_step": trainer.global_step}))


def main(out: Path, max_steps: int) -> None:
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        from submitit.core.job_environment import JobEnvironment
        from submitit.core.utils import DelayedSubmission, JobPaths

        delayed = DelayedSubmission(Task())
        delayed.set_timeout(60, 3)
        (out / "submitit").mkdir(exist_ok=True)  # submitit's job folder, which its submission would have made
        JobEnvironment()._handle_signals(JobPaths(out / "submitit", job_id=os.environ["SLURM_JOB_ID"]), delayed)
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
    requeue = SlurmRequeue(signal=os.environ.get("REQUEUE_SIGNAL"))
    callbacks = [requeue, Record(out, requeue)]
    background = bool(os.environ.get("ASYNC_CKPT"))
    if background:
        callbacks.append(SoloCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, keep_last_k=3, async_save=True))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["SLURM_NTASKS_PER_NODE"]),
        strategy=SoloDDP(checkpoint_io=SlowIO()) if background else SoloDDP(),
        callbacks=callbacks,
        max_steps=max_steps,
        default_root_dir=out / "run",
        logger=False,
        enable_checkpointing=background,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
