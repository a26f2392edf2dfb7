"""What the scripts here share: a user's own small model, as it would sit beside a user's training script
(the scripts run as files under torchrun, popen or SLURM variables, from which ``tests`` is not importable;
this file is, being in the script's own directory)."""

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

# No logger, progress bar or model summary: the scripts' output is the files they write.
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def mlp(hidden: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))


class Tiny(L.LightningModule):
    """Cross-entropy on ``net`` with SGD; remembers the step it started at and the lr of its first step."""

    def __init__(self, net: torch.nn.Module | None = None, lr: float = 0.1, momentum: float = 0.0):
        super().__init__()
        self.net = net if net is not None else mlp()
        self.lr, self.momentum = lr, momentum
        self.first_lr = None

    def on_train_start(self):
        self.start_step = self.trainer.global_step

    def training_step(self, batch, batch_idx):
        if self.first_lr is None:
            self.first_lr = self.optimizers().param_groups[0]["lr"]
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class Jittered(Dataset):
    """Random augmentation in the loader workers: Gaussian jitter on every sample."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        return x + 0.1 * torch.randn_like(x), y


class Validated(Tiny):
    """Tiny with a validation loss synchronised over the ranks."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)


def real_loaders(data: TensorDataset, batch_size: int = 8) -> list[DataLoader]:
    """A shuffled training loader with an augmenting worker, and a validation loader with one. Persistent: a worker
    forked during the fit would make the parent copy-on-write every page it writes next."""
    return [
        DataLoader(d, batch_size=batch_size, shuffle=s, num_workers=1, persistent_workers=True)
        for d, s in ((Jittered(data), True), (data, False))
    ]
