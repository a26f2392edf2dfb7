"""SoloDDP through the patterns Lightning's own DDPStrategy tests use (issue 13, item 8).

Mocking ``init_process_group`` here is the point: it is how Lightning unit-tests a strategy's setup
(``tests_pytorch/strategies/test_ddp.py::test_set_timeout``), and SoloDDP must survive it.
"""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_solo import SoloDDP


def _setup_with_mocked_init(strategy: DDPStrategy):
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.strategy.connect(BoringModel())
    trainer.lightning_module.trainer = trainer
    with mock.patch("torch.distributed.init_process_group") as init_mock:
        trainer.strategy.setup_environment()
    return trainer, init_mock


def test_set_timeout_with_mocked_init_process_group():
    """Lightning's ``test_set_timeout``, with SoloDDP: setup needs no live process group."""
    assert not torch.distributed.is_initialized()
    timeout = timedelta(seconds=30)
    trainer, init_mock = _setup_with_mocked_init(SoloDDP(timeout=timeout))
    strategy = trainer.strategy
    init_mock.assert_called_once()
    args, kwargs = init_mock.call_args
    assert args[0] == strategy._get_process_group_backend() == "gloo"
    assert kwargs["timeout"] == timeout
    assert kwargs["rank"] == strategy.cluster_environment.global_rank()
    assert kwargs["world_size"] == strategy.cluster_environment.world_size()
    # Nothing that needs a live group was made; it is made by the first setup that has one.
    assert strategy.side_group is None and not strategy._groups.made
    assert "barrier" not in strategy.decisions
    assert strategy.decisions["precision"].value == "32-true"


def test_subclass_keeps_soloddp_behaviour():
    """A user's subclass (Lightning's tests subclass DDPStrategy the same way) registers nothing twice and
    goes through the same mocked setup."""
    calls = []

    class MyDDP(SoloDDP):
        def setup_environment(self) -> None:
            calls.append("setup_environment")
            super().setup_environment()

    strategy = MyDDP(timeout=12, find_unused_parameters=True)
    assert isinstance(strategy, DDPStrategy)
    trainer, init_mock = _setup_with_mocked_init(strategy)
    assert trainer.strategy is strategy and calls == ["setup_environment"]
    assert init_mock.call_args.kwargs["timeout"] == timedelta(seconds=12)
    assert strategy.decisions["find_unused_parameters"].value is True


@pytest.mark.parametrize(("name", "start_method"), [("solo_ddp", None), ("solo_ddp_notebook", "fork")])
def test_registry_names(name, start_method):
    assert name in StrategyRegistry
    entry = StrategyRegistry[name]
    assert entry["strategy"] is SoloDDP
    strategy = StrategyRegistry.get(name)
    assert type(strategy) is SoloDDP
    if start_method is not None:
        assert strategy._start_method == start_method
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False, enable_checkpointing=False)
    assert type(trainer.strategy) is SoloDDP
    assert "ddp" in StrategyRegistry and StrategyRegistry["ddp"]["strategy"] is DDPStrategy


def test_setup_environment_before_a_lightning_module_is_attached():
    """Lightning's ``test_all_gather`` sets a strategy's environment up with no LightningModule connected."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=SoloDDP(), logger=False)
    strategy = trainer.strategy
    assert strategy.lightning_module is None
    with mock.patch("torch.distributed.init_process_group"):
        strategy.setup_environment()
    assert strategy.decisions["precision"].value == "32-true"


class _UserModel(pl.LightningModule):
    """Written as Lightning's docs write such models: a parameter on the LightningModule itself (a class token),
    a reentrant activation-checkpointed block, and optionally a contrastive gather whose backward all-reduces."""

    def __init__(self, reentrant: bool = True, gather: bool = False) -> None:
        super().__init__()
        self.cls_token = torch.nn.Parameter(torch.randn(1, 8))
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
        self.head = torch.nn.Linear(8, 2)
        self.reentrant, self.gather = reentrant, gather

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.utils.checkpoint.checkpoint(self.block, x + self.cls_token, use_reentrant=self.reentrant)
        loss = torch.nn.functional.cross_entropy(self.head(h), y)
        if self.gather:  # SimCLR-style: every rank's embeddings, gradients flowing back through all of them
            everyone = torch.cat(torch.distributed.nn.functional.all_gather(h))
            loss = loss + 0.01 * everyone.pow(2).mean()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_user_model(rank, world_size, strategy_name, reentrant, gather):
    import os

    from torch.utils.data import DataLoader, TensorDataset

    os.environ["LOCAL_RANK"] = str(rank)
    pl.seed_everything(0)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    strategy = SoloDDP() if strategy_name == "solo" else DDPStrategy()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=8, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    model = _UserModel(reentrant, gather)
    trainer.fit(model, DataLoader(data, batch_size=4))
    decisions = {k: str(v) for k, v in getattr(trainer.strategy, "decisions", {}).items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, decisions


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("reentrant", "gather"), [(True, False), (False, True)])
def test_user_model_trains_as_under_stock_ddp(reentrant, gather, capfd):
    """A root-module parameter (the fast path once looked its sentinel up with ``list.index``, comparing tensors),
    reentrant checkpointing (DDP's search fails it: "marked as ready twice"), and a gather whose backward
    all-reduces (seen in the evidence window, so "auto" stays on True): SoloDDP() trains each to stock's
    weights, without DDP's C++ warning about a find_unused_parameters the user never set."""
    from tests.distributed import run_ranks

    solo = run_ranks(_fit_user_model, 2, "solo", reentrant, gather, timeout=110)
    # Quiet: DDP's note that find_unused_parameters=True found nothing unused names a setting the user never set.
    assert "did not find any unused parameters" not in capfd.readouterr().err
    stock = run_ranks(_fit_user_model, 2, "stock", reentrant, gather, timeout=110)
    for (weights, _), (reference, _) in zip(solo, stock):
        for name, value in reference.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
    decisions = solo[0][1]
    if reentrant:
        assert "non-reentrant while DDP searches" in decisions["reentrant_checkpoint"]
        assert "DDP's fast path" in decisions["find_unused_parameters"]
    if gather:
        reason = decisions["find_unused_parameters"]
        assert "= True (torch.distributed." in reason and "communicates inside backward" in reason
