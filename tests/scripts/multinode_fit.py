"""Fit a tiny model with ``Trainer(strategy=SoloDDP())`` under torchrun (one process per node here).

    torchrun --nnodes 2 --nproc-per-node 1 ... tests/scripts/multinode_fit.py OUT_DIR

Each rank writes OUT_DIR/rank<k>.json: its ranks as Lightning sees them, the cluster environment, the global
batch and lr scale WarmupScaledLR decided, the lr of the first step and its final parameters' checksum.
"""

import json
import sys
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from user_model import QUIET, Tiny

from lightning_solo import SoloDDP
from lightning_solo.callbacks import WarmupScaledLR


def main(out: Path) -> None:
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    lr = WarmupScaledLR(reference_batch_size=64, warmup_steps=0, log_lr=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy=SoloDDP(),
        callbacks=[lr],
        max_epochs=1,
        enable_checkpointing=False,
        **QUIET,
    )
    model = Tiny(lr=0.8)
    trainer.fit(model, DataLoader(data, batch_size=8))
    record = {
        "global_rank": trainer.global_rank,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
        "decisions": {k: d.value for k, d in {**trainer.strategy.decisions, **lr.decisions}.items()},
        "first_lr": model.first_lr,
        "global_step": trainer.global_step,
        "params": float(torch.nn.utils.parameters_to_vector(model.parameters()).double().sum()),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
