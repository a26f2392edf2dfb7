"""A 2-process CPU fit (popen launcher) that writes its checkpoints in the background, each background write 2 s, stopped by
SIGTERM on rank 1 at step 5 while a write is in flight.

    python tests/scripts/async_sigterm_fit.py OUT_DIR

Rank 0 writes OUT_DIR/result.json: how its fit ended and the checkpoint directory's listing right after it.
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
from user_model import QUIET, Tiny

from lightning_solo import SoloDDP
from lightning_solo.callbacks import SoloCheckpoint
from lightning_solo.checkpoint import SoloCheckpointIO


class SlowIO(SoloCheckpointIO):
    def write_file(self, checkpoint, path, manifest):
        if threading.current_thread() is not threading.main_thread():  # a background write; the stop's own is not
            time.sleep(2.0)
        super().write_file(checkpoint, path, manifest)


class SigtermAtStep5(Tiny):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def main(out: Path) -> None:
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
    ckpt = SoloCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, keep_last_k=20, save_last=False,
                          async_save=True)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=SoloDDP(checkpoint_io=SlowIO()), callbacks=[ckpt], max_steps=40,
        default_root_dir=out, **QUIET,
    )  # fmt: skip
    ended = "normally"
    try:
        trainer.fit(SigtermAtStep5(), DataLoader(data, batch_size=8))
    except BaseException as err:  # noqa: BLE001 - recorded
        ended = type(err).__name__
    if trainer.global_rank == 0:
        listing = sorted(os.listdir(out / "ckpt"))
        (out / "result.json").write_text(json.dumps({"ended": ended, "listing": listing}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
