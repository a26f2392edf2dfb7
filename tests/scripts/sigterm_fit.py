"""A 2-process CPU fit (popen launcher) in which one rank alone gets SIGTERM, as a preempted node's process does;
then, with ``resume``, the fit resumed from the newest checkpoint.

    python tests/scripts/sigterm_fit.py RANK BATCH OUT_DIR [resume]

SoloDDP's defaults with WarmupScaledLR, SoloCheckpoint (every 2 steps, and on the exception), accumulation 2,
loader workers with random augmentation and validation inside the epoch. Rank RANK sends itself SIGTERM at the end
of training batch BATCH. Each rank writes OUT_DIR/rank<k>.json: how its fit ended (the exception's type, the
global step and the batch it stopped at) and the strategy's ``sigterm_check`` decision.
"""

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import TensorDataset
from user_model import QUIET, Validated, mlp, real_loaders

from lightning_solo import SoloDDP
from lightning_solo.callbacks import SoloCheckpoint, WarmupScaledLR
from lightning_solo.checkpoint import resolve_ckpt_path


class SigtermAt(L.Callback):
    def __init__(self, rank: int, batch: int) -> None:
        self.rank, self.batch, self.record = rank, batch, {"ended": "normally"}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.record["last_batch"] = trainer.fit_loop.epoch_loop.total_batch_idx
        if trainer.global_rank == self.rank and self.record["last_batch"] == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer, pl_module, exception):
        self.record["ended"] = type(exception).__name__


def main(rank: int, batch: int, out: Path, resume: bool) -> None:
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))  # 16 batches per rank
    watch = SigtermAt(-1 if resume else rank, batch)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=SoloDDP(), max_epochs=1, accumulate_grad_batches=2,
        val_check_interval=4, limit_val_batches=2, num_sanity_val_steps=0,
        callbacks=[
            WarmupScaledLR(reference_batch_size=32, warmup_steps=2, log_lr=False),
            SoloCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, keep_last_k=1, save_on_exception=True),
            watch,
        ],
        default_root_dir=out, **QUIET,
    )  # fmt: skip
    loaders = real_loaders(data)
    try:
        trainer.fit(
            Validated(mlp(), lr=0.05),
            *loaders,
            ckpt_path=resolve_ckpt_path("auto", out / "ckpt") if resume else None,
        )
    finally:
        record = {
            **watch.record,
            "global_step": trainer.global_step,
            "received_sigterm": trainer.received_sigterm,
            "decision": trainer.strategy.decisions["sigterm_check"].as_dict(),
            # After teardown the trainer has Lightning's own check and notifier back.
            "given_back": not {"_broadcast_sigterm_tensor", "_sigterm_notifier_fn"}
            & {*vars(trainer.fit_loop.epoch_loop), *vars(trainer._signal_connector)},
        }
        name = f"rank{trainer.global_rank}{'.resumed' if resume else ''}.batch{batch}.json"
        (out / name).write_text(json.dumps(record))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:] == ["resume"])
