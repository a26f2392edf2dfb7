"""SoloDDP.barrier: a rank that never arrives is named, within the collective timeout, instead of a hang."""

import time
from datetime import timedelta

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo import SoloDDP
from lightning_solo.comm import barrier_group, monitored_barrier
from tests.distributed import run_ranks


def _late_rank_two(rank: int, world_size: int) -> str:
    timeout = timedelta(seconds=1.5)
    group = barrier_group(timeout)
    monitored_barrier("everyone", timeout, group)  # all arrive: passes
    if rank == 2:
        time.sleep(3)
    try:
        monitored_barrier("late", timeout, group)
    except RuntimeError as err:
        return str(err)
    return "passed"


@pytest.mark.multiproc
@pytest.mark.timeout(40)
def test_monitored_barrier_names_every_missing_rank():
    r0, r1, _ = run_ranks(_late_rank_two, 3)
    assert "barrier 'late' timed out after 1.5 s: rank(s) [2] did not arrive" in r0
    assert "rank 0's error names the ranks" in r1


class SleepyRankOne(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def on_train_start(self):
        if self.global_rank == 1:
            time.sleep(6)
        self.trainer.strategy.barrier("after_sleep")

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_soloddp_barrier_names_the_sleeping_rank():
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(start_method="fork", timeout=3),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.monotonic()
    with pytest.raises(Exception, match=r"barrier 'after_sleep' timed out after 3 s: rank\(s\) \[1\] did not arrive"):
        trainer.fit(SleepyRankOne())
    assert time.monotonic() - start < 30
