"""Under the fork launcher (notebooks), a SIGTERM stop ends the parent's ``trainer.fit``: it raises Lightning's
``SIGTERMException``, as rank 0's fit does under popen. Before, rank 0 ended with status 0 and put no result, and
the parent waited in the launcher's ``return_queue.get()`` for ever."""

import os
import signal

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo import SoloDDP
from lightning_solo.checkpoint import verify
from tests.helpers.modules import TinyModule

BATCH = 2  # the signal comes at the end of this training batch (of 8 per rank)


class SigtermTo(L.Callback):
    """The ranks in ``ranks`` send themselves SIGTERM at the end of training batch ``BATCH``."""

    ranks: tuple[int, ...] = ()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == BATCH and trainer.global_rank in self.ranks:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_a_sigterm_stop_under_the_fork_launcher_ends_the_parents_fit(tmp_path):
    signaller = SigtermTo()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=SoloDDP(start_method="fork"), max_epochs=1,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt"), signaller], default_root_dir=tmp_path,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    stopped = tmp_path / "ckpt" / "on_sigterm.ckpt"
    # Rank 0 alone, rank 1 alone, both (with a loader worker each): one Trainer, which fits again each time.
    for ranks, workers in (((0,), 0), ((1,), 0), ((0, 1), 1)):
        signaller.ranks = ranks  # the forked ranks read it
        with pytest.raises(SIGTERMException):
            trainer.fit(TinyModule(), DataLoader(data, batch_size=4, num_workers=workers))
        assert trainer.state.status == TrainerStatus.INTERRUPTED, ranks
        manifest = verify(stopped)  # every rank stopped together, and saved there
        assert manifest["trigger"] == "sigterm" and BATCH < manifest["global_step"] <= BATCH + 3, (ranks, manifest)
        stopped.unlink()
