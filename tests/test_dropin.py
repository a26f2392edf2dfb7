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
    assert strategy._barrier_group is None and not strategy._barrier_made
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
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=name, logger=False, enable_checkpointing=False
    )
    assert type(trainer.strategy) is SoloDDP
    assert "ddp" in StrategyRegistry and StrategyRegistry["ddp"]["strategy"] is DDPStrategy
