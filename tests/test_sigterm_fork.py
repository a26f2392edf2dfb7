"""Under the fork launcher (notebooks), a SIGTERM stop ends the parent's ``trainer.fit``: it raises Lightning's
``SIGTERMException``, as rank 0's fit does under popen. Before, rank 0 ended with status 0 and put no result, and
the parent waited in the launcher's ``return_queue.get()`` for ever.

The parent is this file run as a script (a fresh process, as a notebook's kernel starts): one Trainer fits three
times, the signal to rank 0 alone, to rank 1 alone, then to both with a loader worker each."""

import json
import os
import signal
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo import SoloDDP
from lightning_solo.checkpoint import verify
from tests.helpers import run_driver
from tests.helpers.modules import TinyModule

BATCH = 2  # the signal comes at the end of this training batch (of 8 per rank)
CASES = (((0,), 0), ((1,), 0), ((0, 1), 1))  # (the ranks signalled, loader workers)


class SigtermTo(L.Callback):
    """The ranks in ``ranks`` send themselves SIGTERM at the end of training batch ``BATCH``."""

    ranks: tuple[int, ...] = ()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == BATCH and trainer.global_rank in self.ranks:
            os.kill(os.getpid(), signal.SIGTERM)


def _three_fits(tmp: str) -> list[dict]:
    signaller = SigtermTo()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=SoloDDP(start_method="fork"), max_epochs=1,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(tmp, "ckpt")), signaller], default_root_dir=tmp,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    stopped = os.path.join(tmp, "ckpt", "on_sigterm.ckpt")
    fits = []
    for ranks, workers in CASES:
        signaller.ranks = ranks  # the forked ranks read it
        raised = None
        try:
            trainer.fit(TinyModule(), DataLoader(data, batch_size=4, num_workers=workers))
        except SIGTERMException as err:
            raised = type(err).__name__
        manifest = verify(stopped)  # every rank stopped together, and saved there
        fits.append({"raised": raised, "status": trainer.state.status.value, "trigger": manifest["trigger"],
                     "step": manifest["global_step"]})  # fmt: skip
        os.unlink(stopped)
    return fits


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_a_sigterm_stop_under_the_fork_launcher_ends_the_parents_fit(tmp_path):
    fits = run_driver(__file__, tmp_path, timeout=80)["fits"]
    assert len(fits) == len(CASES), fits
    for (ranks, _), fit in zip(CASES, fits):
        assert fit["raised"] == "SIGTERMException" and fit["status"] == "interrupted", (ranks, fit)
        assert fit["trigger"] == "sigterm" and BATCH < fit["step"] <= BATCH + 3, (ranks, fit)


if __name__ == "__main__":
    print(json.dumps({"fits": _three_fits(sys.argv[1])}))
