"""Fit a tiny model on 2 CPU processes with the popen launcher (re-runs this script for rank 1), twice in the same
processes: first ``strategy="solo_ddp"``, then ``strategy=SoloDDP(watchdog=...)`` with the small thresholds of the
fault-injection runs (tests/scripts/hang_fit.py), which a healthy run must not trip (the second Trainer joins the
ranks and the process group the first one made, as a script with two fits does).

    python tests/scripts/tiny_fit.py OUT_DIR

Each rank writes each fit's parameter vector to OUT_DIR/<mode>/rank<k>.pt; rank 0 also writes the strategy type.
"""

import sys
from pathlib import Path

import lightning_solo

# isort: split
import lightning as L
import torch
from hang_fit import WATCHDOG  # the fault-injection runs' small thresholds
from torch.utils.data import DataLoader, TensorDataset
from user_model import QUIET, Tiny

from lightning_solo import SoloDDP


def fit(mode: str, out: Path) -> None:
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    strategy = "solo_ddp" if mode == "string" else SoloDDP(watchdog=WATCHDOG)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        enable_checkpointing=False,
        **QUIET,
    )
    model = Tiny()
    trainer.fit(model, DataLoader(data, batch_size=8))
    rank = trainer.global_rank
    out.mkdir(parents=True, exist_ok=True)
    torch.save(torch.nn.utils.parameters_to_vector(model.parameters()).detach(), out / f"rank{rank}.pt")
    if rank == 0:
        (out / "strategy.txt").write_text(
            f"{type(trainer.strategy).__name__} {trainer.world_size} {trainer.global_step} {lightning_solo.__file__}"
        )


if __name__ == "__main__":
    for mode in ("string", "instance"):
        fit(mode, Path(sys.argv[1]) / mode)
