"""Two fork-launched fits after this process ran a parallel CPU op, the ranks with 2 threads each (the user's
``OMP_NUM_THREADS=2``, which Lightning keeps), each step running parallel ops: without the launcher's release of
OpenMP's thread pool, rank 0 hangs at its first one.

    OMP_NUM_THREADS=2 python tests/scripts/fork_after_openmp.py solo|stock OUT_DIR

Writes OUT_DIR/done.json after both fits.
"""

import json
import sys
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo import SoloDDP


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        assert torch.get_num_threads() == 2
        noise = torch.randn(1_000_000).mul(2).add(1).abs().sum()  # parallel regions, as a large batch's ops are
        return self.layer(x).pow(2).mean() + 0 * noise

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    kind, out = sys.argv[1], Path(sys.argv[2])
    big = torch.randn(4_000_000)
    (big + big).sum()  # the parent's own parallel op (a notebook cell)
    for _ in range(2):
        strategy = SoloDDP(start_method="fork") if kind == "solo" else DDPStrategy(start_method="fork")
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            default_root_dir=out)  # fmt: skip
        trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4))
        (big * 3).sum()  # and again between the fits
    (out / "done.json").write_text(json.dumps({"fits": 2, "steps": trainer.global_step}))
