"""The launcher chosen by context: ``SoloDDP()`` forks inside Jupyter/IPython and re-runs the script elsewhere.

A notebook is simulated the way IPython marks one, by setting ``sys.ps1``; Lightning's own interactive check
(``_IS_INTERACTIVE``, fixed when Lightning is imported) is switched on alongside, so that the Trainer applies
its notebook rule (only an interactive-compatible launcher is allowed) to the strategy SoloDDP built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors import accelerator_connector
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_solo import SoloDDP
from lightning_solo.core import openmp
from lightning_solo.ddp.launcher import decide_start_method
from tests.helpers import REPO


@pytest.fixture
def notebook(monkeypatch):
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    monkeypatch.setattr(accelerator_connector, "_IS_INTERACTIVE", True)


@pytest.fixture
def script(monkeypatch):
    monkeypatch.delattr(sys, "ps1", raising=False)
    assert not sys.flags.interactive


def test_script_gets_the_subprocess_launcher(script):
    assert decide_start_method("auto").value == "popen"
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SoloDDP(), logger=False)
    assert isinstance(trainer.strategy._launcher, _SubprocessScriptLauncher)
    assert trainer.strategy.decisions["start_method"].value == "popen"


def test_notebook_gets_fork_with_the_same_name(notebook):
    decision = decide_start_method("auto")
    assert decision.value == "fork" and "interactive" in decision.reason
    for strategy in (SoloDDP(), "solo_ddp"):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
        launcher = trainer.strategy._launcher
        assert isinstance(launcher, _MultiProcessingLauncher) and launcher.is_interactive_compatible
        assert trainer.strategy.decisions["start_method"].value == "fork"


def test_notebook_refuses_an_explicit_script_launcher(notebook):
    # What "auto" avoids: Lightning rejects a non-forking launcher in a notebook.
    with pytest.raises(MisconfigurationException, match="interactive environment"):
        L.Trainer(accelerator="cpu", devices=2, strategy=SoloDDP(start_method="popen"), logger=False)


def test_explicit_start_method_is_kept_and_bad_one_rejected(notebook):
    decision = decide_start_method("spawn")
    assert decision.value == "spawn" and "user" in decision.reason
    with pytest.raises(ValueError, match="'auto', 'popen', 'spawn', 'fork', 'forkserver'"):
        SoloDDP(start_method="thread")


def test_notebook_fork_after_cuda_init_fails_before_forking(notebook, monkeypatch):
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel

    def no_fork():
        raise AssertionError("forked after CUDA was initialised")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr("os.fork", no_fork)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(),
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(RuntimeError, match="Restart the kernel"):
        trainer.fit(BoringModel())


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_forked_ranks_run_parallel_ops_after_the_parent_did(tmp_path):
    # A notebook's kernel ran a large CPU op, then fits twice with the fork launcher, 2 threads per rank: each
    # rank's first parallel op would wait forever in OpenMP's inherited pool (stock DDPStrategy(start_method=
    # "fork") does: benchmarks/RESULTS.md). Fresh process: OMP_NUM_THREADS=2 must be read when torch loads.
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    script = REPO / "tests" / "scripts" / "fork_after_openmp.py"
    proc = subprocess.run([sys.executable, str(script), "solo", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=90)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((tmp_path / "done.json").read_text()) == {"fits": 2, "steps": 3}


def test_releasing_the_thread_pool_leaves_this_process_parallel():
    # torch's CPU build runs on OpenMP here: the runtime pauses, and the next op opens a new pool.
    assert openmp.release_thread_pool()
    x = torch.randn(2_000_000)
    assert torch.equal(x + x, 2 * x)
