"""The tests' one LightningModule: a tiny MLP on random data under SGD. A test that needs a different model
passes options, or subclasses it and overrides the one hook it tests (a failure in ``training_step``, an
optimizer in ``configure_optimizers``, its own data in ``train_dataloader``).

    model = TinyModule((8, 16, 4), loss="cross_entropy", lr=0.1, samples=64, data_seed=0)
    L.Trainer(accelerator="cpu", max_epochs=1).fit(model)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# loss name -> (loss of the outputs for the batch, the targets the random data carry: None, "values", "classes")
LOSSES = {
    "sum": (lambda out, batch: out.sum(), None),
    "square": (lambda out, batch: out.pow(2).mean(), None),
    "mse": (lambda out, batch: F.mse_loss(out, batch[1]), "values"),
    "cross_entropy": (lambda out, batch: F.cross_entropy(out, batch[1]), "classes"),
}


class TinyModule(L.LightningModule):
    """``trunk`` (the hidden layers) then ``out`` (the last Linear), trained on random data under SGD.

    * ``widths``: the layer widths, inputs first: ``(4, 1)`` is one ``Linear(4, 1)`` (an empty trunk),
      ``(8, 16, 4)`` is ``Linear(8, 16)``, the activation, ``Linear(16, 4)``. Each hidden Linear is followed by
      ``BatchNorm1d`` (``batchnorm``), ``activation`` (``None``: none) and ``Dropout(dropout)``, in that order.
    * ``trunk``: a given network in place of the hidden layers; ``widths`` is then ``(features, outputs)`` of
      ``out``, or ``()`` for no ``out`` (the trunk is the whole model).
    * ``head``: also an ``nn.Linear(hidden, 3)`` that ``forward`` never calls (a parameter never used).
    * ``init_seed``: ``torch.manual_seed(init_seed)`` before the layers are built (else the global RNG as is).
    * ``loss``: a name in :data:`LOSSES`; ``mse`` and ``cross_entropy`` data carry targets.
    * ``samples`` random inputs in batches of ``batch_size`` (also declared as ``self.batch_size``, which the
      auto rules read), drawn when the loader is built from ``data_seed`` (``None``: the global RNG).
    * ``torch.optim.SGD`` with ``lr``, ``momentum``, ``weight_decay``; ``scheduler(optimizer)``, if given, is
      stepped after every optimizer step.
    """

    def __init__(
        self,
        widths: Sequence[int] = (4, 1),
        *,
        trunk: nn.Module | None = None,
        activation: type[nn.Module] | None = nn.Tanh,
        batchnorm: bool = False,
        dropout: float = 0.0,
        head: bool = False,
        init_seed: int | None = None,
        loss: str = "sum",
        samples: int = 16,
        batch_size: int = 2,
        data_seed: int | None = None,
        shuffle: bool = False,
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None,
    ) -> None:
        super().__init__()
        if init_seed is not None:
            torch.manual_seed(init_seed)
        self.trunk = trunk if trunk is not None else _hidden_layers(widths, activation, batchnorm, dropout)
        self.out = nn.Linear(widths[-2], widths[-1]) if widths else nn.Identity()
        if head:
            self.head = nn.Linear(widths[-2], 3)
        self.widths, self.loss = tuple(widths), loss
        self.samples, self.batch_size, self.data_seed, self.shuffle = samples, batch_size, data_seed, shuffle
        self.lr, self.momentum, self.weight_decay, self.scheduler = lr, momentum, weight_decay, scheduler

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.trunk(x))

    def batch_loss(self, batch) -> torch.Tensor:
        return LOSSES[self.loss][0](self(batch[0]), batch)

    def training_step(self, batch, batch_idx):
        return self.batch_loss(batch)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(
            self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        if self.scheduler is None:
            return optimizer
        scheduler = {"scheduler": self.scheduler(optimizer), "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def train_dataloader(self):
        g = None if self.data_seed is None else torch.Generator().manual_seed(self.data_seed)
        tensors = [torch.randn(self.samples, self.widths[0], generator=g)]
        targets = LOSSES[self.loss][1]
        if targets == "values":
            tensors.append(torch.randn(self.samples, self.widths[-1], generator=g))
        elif targets == "classes":
            tensors.append(torch.randint(0, self.widths[-1], (self.samples,), generator=g))
        return DataLoader(TensorDataset(*tensors), batch_size=self.batch_size, shuffle=self.shuffle)


def _hidden_layers(
    widths: Sequence[int], activation: type[nn.Module] | None, batchnorm: bool, dropout: float
) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width_in, width in itertools.pairwise(widths[:-1]):
        layers.append(nn.Linear(width_in, width))
        layers += [nn.BatchNorm1d(width)] if batchnorm else []
        layers += [activation()] if activation is not None else []
        layers += [nn.Dropout(dropout)] if dropout else []
    return nn.Sequential(*layers)
