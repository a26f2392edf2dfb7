"""SoloFSDP's sharded checkpoints written in the background (SoloCheckpoint(async_save=True)) on 2 CPU processes (the
popen launcher re-runs this script for rank 1), against synchronous ones.

    python tests/scripts/fsdp_async_fit.py OUT_DIR

In the same processes: ``sync``: 3 epochs of 4 steps, a checkpoint at each epoch's end; ``async``: the same fit
for 2 epochs, each DCP write held back 0.6 s (training goes on meanwhile); ``resume``: ``fit(ckpt_path="auto")``
from what ``async`` left, to the end of epoch 3. Rank 0 writes OUT_DIR/result.json: each fit's checkpoint
directory listing, the full trained weights, what ``decide_resume`` chose while a write was in flight (with the
directory listing then), and the async writer's statistics.
"""

import json
import sys
import time
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset
from user_model import QUIET, Tiny, mlp

from lightning_solo.callbacks import SoloCheckpoint
from lightning_solo.checkpoint import decide_resume, resolve_ckpt_path
from lightning_solo.fsdp.strategy import SoloFSDP

WRITE_DATA = FileSystemWriter.write_data


def slow_write_data(self, plan, planner):  # on DCP's thread: the shards reach the disk 0.6 s late
    time.sleep(0.6)
    return WRITE_DATA(self, plan, planner)


class InFlight(L.Callback):
    """The first step after an epoch-end save (rank 0): the directory and what a resume would choose, mid-write."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.ckpt_dir, self.seen = ckpt_dir, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero and batch_idx == 0 and trainer.current_epoch > 0:
            listing = sorted(p.name for p in self.ckpt_dir.iterdir())
            self.seen.append({"listing": listing, "chosen": decide_resume(self.ckpt_dir).value})


def fit(out: Path, name: str, epochs: int, async_save: bool, resume: bool = False) -> dict:
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    ckpt_dir = out / name
    ckpt = SoloCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, keep_last_k=3, async_save=async_save)
    in_flight = InFlight(ckpt_dir)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=SoloFSDP(min_num_params=100), callbacks=[ckpt, in_flight],
        max_epochs=epochs, default_root_dir=out, **QUIET,
    )  # fmt: skip
    model = Tiny(mlp(hidden=32), lr=0.2, momentum=0.9)
    ckpt_path = resolve_ckpt_path("auto", ckpt_dir) if resume else None
    trainer.fit(model, DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {
        "listing": sorted(p.name for p in ckpt_dir.iterdir()),
        "weights": {k: v.tolist() for k, v in full.items()},
        "start_step": model.start_step,
        "global_step": trainer.global_step,
        "in_flight": in_flight.seen,
        "async_save": ckpt.decisions["async_save"].value,
        "waits": ckpt.decisions["async_save_waits"].value if "async_save_waits" in ckpt.decisions else None,
        "rank": trainer.global_rank,
    }


def main(out: Path) -> None:
    result = {"sync": fit(out, "sync", 3, async_save=False)}
    FileSystemWriter.write_data = slow_write_data
    result["async"] = fit(out, "async", 2, async_save=True)
    result["resume"] = fit(out, "async", 3, async_save=True, resume=True)
    FileSystemWriter.write_data = WRITE_DATA
    if result["sync"]["rank"] == 0:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
