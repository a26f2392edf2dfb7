"""Fit a wide MLP on 2 CPU processes (popen launcher: fresh processes, so glibc's malloc starts untouched) with
SoloDDP's defaults, WarmupScaledLR, SoloCheckpoint every 4 steps, accumulation 2, loader workers with random
augmentation and validation inside the epoch; count each training batch's page faults.

    python tests/scripts/malloc_fit.py on|off OUT_DIR     # SoloDDP(cpu_malloc_reuse=True|False)

Post-local-SGD from step 2 and no average before the end: its local steps run under ``no_sync``, where glibc's
default malloc faults the gradients in afresh (``malloc_steps.py``).

Each rank writes OUT_DIR/rank<k>.json: the minor page faults of every training batch, the size of the gradients
in 4 KiB pages, and the strategy's ``cpu_malloc`` decision.
"""

import json
import resource
import sys
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from torch.utils.data import TensorDataset
from user_model import QUIET, Validated, real_loaders

from lightning_solo import SoloDDP
from lightning_solo.callbacks import SoloCheckpoint, WarmupScaledLR

WIDTH = 2048  # three 16 MiB weight matrices: blocks glibc hands back to the kernel by default


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class CountFaults(L.Callback):
    def __init__(self) -> None:
        self.per_batch: list[int] = []
        self.lrs: list[float] = []  # each batch's, as WarmupScaledLR (before this callback) applied it

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start = faults()
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_batch.append(faults() - self.start)


def main(mode: str, out: Path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, WIDTH), torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 2),
    )  # fmt: skip
    data = TensorDataset(torch.randn(384, 8), torch.randint(0, 2, (384,)))  # 24 batches per rank
    lr = WarmupScaledLR(reference_batch_size=16, warmup_steps=4, log_lr=False)
    ckpt = SoloCheckpoint(dirpath=out / "ckpt", every_n_train_steps=4, keep_last_k=1)
    count = CountFaults()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(
            cpu_malloc_reuse=mode == "on",
            comm_hook="post_local_sgd",
            local_sgd_warmup=2,
            local_sgd_period=1000,
        ),
        max_epochs=1,
        accumulate_grad_batches=2,
        val_check_interval=6,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[lr, ckpt, count],
        **QUIET,
    )
    model = Validated(net, lr=0.01, momentum=0.9)
    loaders = real_loaders(data)
    trainer.fit(model, *loaders)
    grad_pages = sum(p.numel() * p.element_size() for p in net.parameters()) // 4096
    decision = trainer.strategy.decisions["cpu_malloc"].as_dict()
    record = {"faults": count.per_batch, "grad_pages": grad_pages, "decision": decision,
              "checkpoints": sorted(f.name for f in (out / "ckpt").glob("*.ckpt")), "lrs": count.lrs}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
