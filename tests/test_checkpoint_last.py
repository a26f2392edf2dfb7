"""`last.ckpt` always holds the newest state, also when the monitored metric stops improving
(stock ModelCheckpoint in Lightning 2.6 leaves it at the last top-k step)."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo.callbacks import SoloCheckpoint
from tests.helpers.modules import TinyModule


class Worsening(TinyModule):
    def __init__(self):
        super().__init__((4, 2))

    def validation_step(self, batch, batch_idx):
        self.log("val/acc", torch.tensor(1.0 - 0.1 * self.current_epoch))  # best at epoch 0


def _last_step(callback_cls, tmp_path) -> tuple[int, int]:
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    ckpt = callback_cls(dirpath=tmp_path, monitor="val/acc", mode="max", save_top_k=1, save_last=True)
    trainer = L.Trainer(
        max_epochs=3, callbacks=[ckpt], logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(Worsening(), data, data)
    return torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"], trainer.global_step


@pytest.mark.timeout(60)
def test_last_is_the_newest_state(tmp_path):
    saved, true = _last_step(SoloCheckpoint, tmp_path / "solo")
    assert saved == true == 12
    stale, _ = _last_step(ModelCheckpoint, tmp_path / "stock")
    assert stale == 4  # what this fixes: stock stops updating `last` with the top-k checkpoint
