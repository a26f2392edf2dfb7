"""SIGTERM on one rank stops every rank at the same batch (:mod:`lightning_solo.sigterm`), in a real two-process
fit with the defaults a run has; the run then resumes from its checkpoint."""

import json
import subprocess
import sys

import pytest

from lightning_solo.checkpoint import verify
from tests.helpers import REPO

SCRIPT = REPO / "tests" / "scripts" / "sigterm_fit.py"


def fit(out, batch: int = 5, *args: str) -> list[dict]:
    """Rank 1 gets SIGTERM after training batch ``batch`` (of 16)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "1", str(batch), str(out), *args], cwd=out,
                          capture_output=True, text=True, timeout=110)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    suffix = ".resumed" if args else ""
    return [json.loads((out / f"rank{r}{suffix}.batch{batch}.json").read_text()) for r in range(2)]


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_sigterm_on_one_rank_stops_every_rank_at_the_same_batch(tmp_path):
    # Stock Lightning 2.6 here: rank 1 raises alone after batch 5, and rank 0 fails in its next all-reduce
    # ("Connection closed by peer" on gloo; on NCCL it waits for the timeout).
    stopped = fit(tmp_path)
    for rank in stopped:
        assert rank["ended"] == "SIGTERMException", rank
        assert rank["decision"]["value"] == "any rank, asynchronous", rank["decision"]
        assert rank["given_back"], rank
    assert stopped[0]["last_batch"] == stopped[1]["last_batch"] in (6, 7), stopped  # within two batches
    assert stopped[0]["global_step"] == stopped[1]["global_step"], stopped
    verify(tmp_path / "ckpt" / "on_exception.ckpt")
    # resume=auto passes over the exception-time save for the newest regular one, and the fit completes.
    for rank in fit(tmp_path, 5, "resume"):
        assert rank["ended"] == "normally" and rank["global_step"] == 8 and rank["given_back"], rank


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_sigterm_after_the_last_batch_lets_the_fit_end_and_says_so(tmp_path):
    # Too late for another agreement: the fit ends normally on both ranks, and rank 1's trainer reports the signal.
    ended = fit(tmp_path, 15)
    assert all(rank["ended"] == "normally" and rank["global_step"] == 8 for rank in ended), ended
    assert ended[1]["received_sigterm"] and not ended[0]["received_sigterm"], ended
