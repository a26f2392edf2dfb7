"""The user's training data stays the user's under ``SoloDDP()``, seen through Lightning on 2 gloo ranks: a
callback that previews ``trainer.train_dataloader.dataset[0]`` gets the user's sample (it raised ``TypeError:
cannot unpack non-iterable int object``), ``isinstance`` and the dataset's attributes hold, and a dataset with
only ``__getitems__`` (as Hugging Face datasets) keeps its batched fetching with plain indices. The same fit
under stock ``DDPStrategy`` is the oracle: same previews, same calls, same weights."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

from lightning_solo import SoloDDP
from tests.helpers.modules import TinyModule
from tests.helpers.records import RankRecorder, read_rank_records


class Points(Dataset):
    """A map-style dataset of the usual shape, with an attribute a preview callback reads."""

    classes = ("low", "high")

    def __init__(self) -> None:
        self.x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], i


class BatchFetched(Dataset):
    """``__getitems__`` and ``__len__`` only, as Hugging Face datasets; it keeps the indices of every call."""

    def __init__(self) -> None:
        self.x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
        self.calls: list = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitems__(self, indices):
        self.calls.append(list(indices) if all(type(i) is int for i in indices) else repr(indices))
        return [(self.x[i], i) for i in indices]


class TwoDatasets(TinyModule):
    def __init__(self) -> None:
        super().__init__((8, 1), loss="square", lr=0.05)

    def training_step(self, batch, batch_idx):
        return self.batch_loss(batch["points"]) + self.batch_loss(batch["batched"])

    def train_dataloader(self):
        return {
            "points": DataLoader(Points(), batch_size=4, shuffle=True),
            "batched": DataLoader(BatchFetched(), batch_size=4, shuffle=True),
        }


def _preview(trainer, module) -> dict:
    """What a sample-preview callback reads at the start of training."""
    points, batched = (trainer.train_dataloader[k].dataset for k in ("points", "batched"))
    x, i = points[0]
    return {
        "sample": [x.tolist(), i],
        "isinstance": [isinstance(points, Points), isinstance(batched, BatchFetched)],
        "classes": list(points.classes),
        "len": [len(points), len(batched)],
    }


def _calls(trainer, module) -> list:
    return trainer.train_dataloader["batched"].dataset.calls


def _fit(out, strategy) -> dict:
    out.mkdir()
    L.seed_everything(0, verbose=False)
    model = TwoDatasets()
    recorder = RankRecorder(out, on_train_start={"preview": _preview}, on_train_end={"calls": _calls})
    L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(model)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_previews_isinstance_and_batched_fetching_are_the_users_as_under_stock_ddp(tmp_path):
    stock = _fit(tmp_path / "stock", DDPStrategy(start_method="fork"))
    solo = _fit(tmp_path / "solo", SoloDDP(start_method="fork"))
    stock_ranks, solo_ranks = read_rank_records(tmp_path / "stock"), read_rank_records(tmp_path / "solo")
    for rank, (theirs, ours) in enumerate(zip(stock_ranks, solo_ranks)):
        assert ours["preview"] == theirs["preview"], f"rank {rank}"
        assert ours["preview"]["isinstance"] == [True, True] and ours["preview"]["classes"] == ["low", "high"]
        # One call per batch, 2 epochs x 4 batches of 4 plain int indices, the same as stock.
        assert ours["calls"] == theirs["calls"] and len(ours["calls"]) == 8, ours["calls"]
        assert all(len(call) == 4 and all(type(i) is int for i in call) for call in ours["calls"])
    for name, value in stock.items():
        assert torch.equal(solo[name], value), name
