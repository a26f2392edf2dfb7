"""SIGTERM on one rank, or on every process of the job (ranks and loader workers, as SLURM sends it), stops every
rank at the same batch (:mod:`lightning_solo.ddp.sigterm`), in a real two-process fit with the defaults a run has; the
stop saves a checkpoint there, and the run resumes from it as if never stopped."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_solo._compat.patch import Patches
from lightning_solo.checkpoint import read_manifest, verify
from lightning_solo.ddp.sigterm import SigtermAgreement
from tests.helpers import REPO

SCRIPT = REPO / "tests" / "scripts" / "sigterm_fit.py"


def fit(out, mode: str, batch: int = 5) -> list[dict]:
    """``mode`` (see the script): the signal comes at the end of training batch ``batch`` (of 16). Returns the
    records of the first of ``+``-joined modes."""
    # A session of its own: "group" signals the script's process group, which must not be pytest's.
    proc = subprocess.run([sys.executable, str(SCRIPT), mode, str(batch), str(out)], cwd=out, capture_output=True,
                          text=True, timeout=110, start_new_session=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = 1 if mode == "alone" else 2
    first = mode.split("+")[0]
    return [json.loads((out / f"rank{r}.{first}.batch{batch}.json").read_text()) for r in range(ranks)]


def weights(out, mode: str) -> list[dict]:
    return [torch.load(out / f"rank{r}.{mode}.pt") for r in range(2)]


def assert_stopped_together(stopped: list[dict], out) -> int:
    """Every rank stopped at the same batch, within two of the signal, and saved ``on_sigterm.ckpt`` there."""
    for rank in stopped:
        assert rank["ended"] == "SIGTERMException", rank
        assert rank["received_sigterm"] and rank["given_back"], rank
        assert rank["decisions"]["sigterm_check"]["value"] == "any rank, asynchronous", rank["decisions"]
        assert rank["decisions"]["sigterm_checkpoint"]["value"] == str(out / "ckpt" / "on_sigterm.ckpt"), rank
    assert stopped[0]["last_batch"] == stopped[1]["last_batch"] in (6, 7), stopped
    assert stopped[0]["global_step"] == stopped[1]["global_step"], stopped
    manifest = verify(out / "ckpt" / "on_sigterm.ckpt")
    assert manifest["trigger"] == "sigterm" and manifest["global_step"] == stopped[0]["global_step"], manifest
    return stopped[0]["global_step"]


def assert_resumes_from_the_stop(out, step: int) -> list[dict]:
    # ckpt_path="auto" takes the stop's checkpoint (newer than the last regular one, and not an exception-time
    # save), and the fit completes; then the never-stopped fit, in the same processes.
    resumed = fit(out, "resume+full")
    for rank in resumed:
        assert rank["ended"] == "normally" and rank["global_step"] == 8 and rank["given_back"], rank
        assert rank["ckpt_path"] == str(out / "ckpt" / "on_sigterm.ckpt") and rank["start_step"] == step, rank
    return resumed


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_sigterm_on_one_rank_stops_every_rank_at_the_same_batch(tmp_path):
    # Stock Lightning 2.6 here: rank 1 raises alone after batch 5, and rank 0 fails in its next all-reduce
    # ("Connection closed by peer" on gloo; on NCCL it waits for the timeout).
    stopped = fit(tmp_path, "one")
    assert stopped[1]["received_at_signal"], stopped[1]  # as Lightning's handler sets it: at once
    assert_stopped_together(stopped, tmp_path)  # the resume from such a stop: the next test
    assert read_manifest(tmp_path / "ckpt" / "on_exception.ckpt")["trigger"] == "exception"


@pytest.mark.multiproc
@pytest.mark.timeout(360)
def test_sigterm_to_every_process_of_the_job_stops_the_ranks_together_and_resumes_exactly(tmp_path):
    # Both ranks and their four loader workers each get SIGTERM. Before: a worker died of it (torch's worker
    # handler ends quietly only on its own rank's SIGTERM), rank 1 failed with "DataLoader worker (pid ...) is
    # killed by signal: Terminated" and rank 0 with "Connection closed by peer", and nothing was saved at the stop.
    stopped = fit(tmp_path, "group")
    assert stopped[0]["received_at_signal"], stopped[0]
    step = assert_stopped_together(stopped, tmp_path)
    assert_resumes_from_the_stop(tmp_path, step)
    # Nothing lost, nothing trained twice: the resumed run ends where the run never stopped ends.
    for resumed, full in zip(weights(tmp_path, "resume"), weights(tmp_path, "full")):
        for name, value in full.items():
            torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_sigterm_after_the_last_batch_lets_the_fit_end_and_says_so(tmp_path):
    # Too late for another agreement: the fit ends normally on both ranks, and rank 1's trainer reports the signal.
    ended = fit(tmp_path, "one", 15)
    assert all(rank["ended"] == "normally" and rank["global_step"] == 8 for rank in ended), ended
    assert ended[1]["received_at_signal"] and ended[1]["received_sigterm"], ended
    assert not ended[0]["received_sigterm"], ended
    assert not (tmp_path / "ckpt" / "on_sigterm.ckpt").exists()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_sigterm_on_one_device_stops_at_the_next_batch_with_a_checkpoint(tmp_path):
    # devices=1: nothing to agree on; the stop comes at the next batch (as Lightning's, after the batch it came in),
    # and saves there as with several ranks.
    (alone,) = fit(tmp_path, "alone")
    assert alone["received_at_signal"] and alone["received_sigterm"] and alone["given_back"], alone
    assert alone["ended"] == "SIGTERMException" and alone["last_batch"] == 5, alone
    assert alone["decisions"]["sigterm_check"]["value"] == "one rank", alone["decisions"]
    manifest = verify(tmp_path / "ckpt" / "on_sigterm.ckpt")
    assert manifest["trigger"] == "sigterm" and manifest["global_step"] == alone["global_step"] == 3, manifest


class _Slow(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        time.sleep(0.01)
        return i


@pytest.mark.timeout(60)
def test_loader_workers_leave_a_sigterm_from_outside_to_their_rank():
    # torch's worker handler dies of any SIGTERM but its rank's, which fails the rank ("DataLoader worker (pid ...)
    # is killed by signal: Terminated"). Shielded, the workers read on; the rank still ends them (quietly).
    patches = Patches()
    agreement = SigtermAgreement(None, patches)
    loader = agreement.shield_workers(DataLoader(_Slow(), batch_size=2, num_workers=2, multiprocessing_context="fork"))
    batches = iter(loader)
    for worker in batches._workers:  # at once, from outside the job's processes, as SLURM's
        kill = f"import os, signal; os.kill({worker.pid}, signal.{signal.SIGTERM.name})"
        subprocess.run([sys.executable, "-c", kill], check=True, timeout=30)
    assert [int(b[0]) for b in batches] == list(range(0, 40, 2))
    del batches
    batches = iter(loader)
    next(batches)
    for worker in batches._workers:
        worker.terminate()  # the rank's own SIGTERM, as torch's shutdown sends it to a worker that hangs
        worker.join(10)
    assert [worker.exitcode for worker in batches._workers] == [0, 0]
    del batches
    patches.close()
    assert loader.worker_init_fn is None and "_get_iterator" not in vars(loader)
