"""The tests' tiny LightningModule: one linear layer, loss = the sum of its outputs, plain SGD, random inputs.
Tests that need a hook of their own subclass it."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyModule(L.LightningModule):
    """``nn.Linear(in_features, out_features)`` trained on ``samples`` random inputs in batches of
    ``batch_size`` (drawn from the global RNG when the loader is built), SGD at ``lr``."""

    def __init__(
        self,
        in_features: int = 4,
        out_features: int = 1,
        *,
        lr: float = 0.01,
        samples: int = 16,
        batch_size: int = 2,
    ) -> None:
        super().__init__()
        self.layer = nn.Linear(in_features, out_features)
        self.lr, self.samples, self.batch_size = lr, samples, batch_size

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(
            TensorDataset(torch.randn(self.samples, self.layer.in_features)), batch_size=self.batch_size
        )
