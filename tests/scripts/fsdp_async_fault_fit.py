"""SoloFSDP, sharded checkpoints written in the background, and rank 1 raising while a write is in flight, on 2 CPU
processes (the popen launcher re-runs this script for rank 1).

    python tests/scripts/fsdp_async_fault_fit.py OUT_DIR

A save every 2 steps into OUT_DIR/ckpt (keep_last_k=2, ``last``), each DCP write held back 1.5 s; at step 5, a
step after step 4's save, rank 1 raises ``ValueError("boom on rank 1")``. Each rank writes OUT_DIR/pid-RANK; rank 1
writes OUT_DIR/raised.json just before it raises: the checkpoint directory's listing then.
"""

import json
import os
import sys
import time
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.utils.data import DataLoader, TensorDataset
from user_model import QUIET, Tiny, mlp

from lightning_solo.callbacks import SoloCheckpoint
from lightning_solo.fsdp.strategy import SoloFSDP

WRITE_DATA = FileSystemWriter.write_data


def slow_write_data(self, plan, planner):  # on DCP's thread: the shards reach the disk 1.5 s late
    time.sleep(1.5)
    return WRITE_DATA(self, plan, planner)


class RaisesOnRank1(Tiny):
    def __init__(self, out: Path) -> None:
        super().__init__(mlp(hidden=32), lr=0.2, momentum=0.9)
        self.out = out

    def on_train_start(self):
        super().on_train_start()
        (self.out / f"pid-{self.global_rank}").write_text(str(os.getpid()))

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 5:
            listing = sorted(p.name for p in (self.out / "ckpt").iterdir())
            (self.out / "raised.json").write_text(json.dumps(listing))
            raise ValueError("boom on rank 1")
        return super().training_step(batch, batch_idx)


def main(out: Path) -> None:
    L.seed_everything(0, verbose=False)
    out.mkdir(parents=True, exist_ok=True)
    FileSystemWriter.write_data = slow_write_data
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
    ckpt = SoloCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, keep_last_k=2, save_last=True, async_save=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=SoloFSDP(min_num_params=100), callbacks=[ckpt], max_steps=20,
        default_root_dir=out, **QUIET,
    )  # fmt: skip
    trainer.fit(RaisesOnRank1(out), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
