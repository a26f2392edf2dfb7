"""SoloDDP by composition (docs/design.md): the one "any rank flagged, all stop" agreement that SIGTERM and SLURM's
requeue share, ``Trainer(sync_batchnorm=True)`` read by each fit's setup and handed back at teardown, and the
public seams the rest of the package reads."""

from __future__ import annotations

import lightning as L
import pytest
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

from lightning_solo import SoloDDP
from lightning_solo.ddp.agreement import Agreement
from lightning_solo.ddp.syncbn import SoloSyncBatchNorm
from tests.distributed import run_ranks
from tests.helpers.modules import TinyModule


def _agree(rank: int, world_size: int) -> tuple[list[bool], bool]:
    agreement = Agreement(dist.new_group(backend="gloo"))
    seen = [agreement.check(rank == 1 and i >= 2) for i in range(5)]  # rank 1 flagged from check 2 on
    return seen, agreement.settle()


@pytest.mark.multiproc
def test_a_flag_on_one_rank_stops_every_rank_at_the_same_check_one_later():
    for seen, settled in run_ranks(_agree, 2):
        assert seen == [False, False, False, True, True] and settled


def test_one_rank_agrees_with_itself_at_once():
    alone = Agreement(None)
    assert [alone.check(flag) for flag in (False, True, False)] == [False, True, False]
    assert not alone.in_flight and not alone.settle()


def _two_fits(rank: int, world_size: int) -> list:
    strategy = SoloDDP(sigterm_agreement=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, sync_batchnorm=True, max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = TinyModule((8, 16, 4), batchnorm=True, loss="cross_entropy", samples=16, batch_size=4)
    seen = []
    for max_steps in (2, 4):
        trainer.fit_loop.epoch_loop.max_steps = max_steps
        trainer.fit(model)
        converted = any(isinstance(m, SoloSyncBatchNorm) for m in model.modules())
        seen.append((strategy.decisions["sync_batchnorm"].reason, converted))
    seen.append(isinstance(strategy._layer_sync, TorchSyncBatchNorm))  # Lightning's attribute, as it found it
    return seen


@pytest.mark.multiproc
def test_every_fit_reads_the_trainers_sync_batchnorm_request_and_teardown_hands_it_back():
    (first, second, request_back) = run_ranks(_two_fits, 1)[0]
    for reason, converted in (first, second):
        assert reason.startswith("Trainer(sync_batchnorm=True)") and not converted  # reverted after the fit
    assert request_back


def test_the_public_seams():
    strategy = SoloDDP(comm_hook="fp16", sync_batchnorm_threshold=8)
    assert strategy.comm_hook.name == "fp16" and strategy.sync_batchnorm_threshold == 8
    assert strategy.side_group is None  # made by the first setup
    assert strategy.decisions["start_method"].value in ("popen", "fork") and strategy.advice == []
