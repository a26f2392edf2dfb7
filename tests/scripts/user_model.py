"""What the scripts here share: a user's own small model, as it would sit beside a user's training script
(the scripts run as files under torchrun, popen or SLURM variables, from which ``tests`` is not importable;
this file is, being in the script's own directory)."""

import lightning as L
import torch

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
