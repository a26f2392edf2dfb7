"""SLURM requeue on the time-limit signal, with SLURM's variables set and a stub ``scontrol`` on PATH (the test plays
slurmctld: it sends the signal, and kills the job once it asked to be requeued), whichever handler owns the signal;
the requeued launch resumes from the verified checkpoint. Also: the submitit launcher config composes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from lightning_solo.checkpoint import decide_resume, verify
from lightning_solo.testing import free_port
from tests.helpers import CONF, REPO

pytestmark = pytest.mark.multiproc

JOB_ID = "4242"
SCRIPT = str(REPO / "tests" / "scripts" / "slurm_fit.py")
MAX_STEPS = 12


def _stub_scontrol(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "scontrol"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    stub.chmod(0o755)
    return bin_dir


def _launch(tmp_path: Path, ntasks: int, env: dict[str, str]) -> list[subprocess.Popen]:
    """One process per task of job JOB_ID on one node, as srun would start them."""
    port = str(free_port())
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    base["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "TORCHELASTIC_RUN_ID"):
        base.pop(var, None)
    base.update(
        SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="train", SLURM_NTASKS=str(ntasks), SLURM_NTASKS_PER_NODE=str(ntasks),
        SLURM_NNODES="1", SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env,
    )  # fmt: skip
    procs = []
    for rank in range(ntasks):
        task_env = {**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}
        log = open(tmp_path / f"launch_{env.get('SLURM_RESTART_COUNT', '0')}_rank{rank}.log", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [sys.executable, SCRIPT, str(tmp_path / "out"), str(MAX_STEPS)],
                env=task_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        )  # fmt: skip
        log.close()
    return procs


def _wait_for(path: Path, procs, timeout: float, tmp_path: Path, text: str = "") -> None:
    """Until ``path`` exists (and holds ``text``); fails early once every process has exited."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        if time.monotonic() > deadline or all(p.poll() is not None for p in procs):
            raise AssertionError(f"{path.name} never held {text or 'anything'!r}:\n{_logs(tmp_path)}")
        time.sleep(0.1)


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("launch_*.log")))


def _kill(procs) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _requeue_then_resume(
    tmp_path: Path, ntasks: int, env: dict[str, str], signalled: list[int], last_words: str = ""
) -> dict:
    """Launch, signal ``signalled`` ranks past step 3, wait for ``scontrol requeue`` (and for rank 0 to log
    ``last_words``), kill the job (as SLURM does on requeue), check the checkpoint, relaunch with
    SLURM_RESTART_COUNT=1; returns what the first launch saw."""
    _stub_scontrol(tmp_path)
    (tmp_path / "out").mkdir()
    first = _launch(tmp_path, ntasks, {**env, "SLOW_STEPS": "1"})
    try:
        for rank in range(ntasks):
            _wait_for(tmp_path / "out" / f"progress{rank}", first, 90, tmp_path)
        for rank in signalled:
            os.kill(first[rank].pid, signal.SIGUSR1)
        _wait_for(tmp_path / "scontrol.log", first, 60, tmp_path)
        # The handler logs after scontrol returns: killing at once would race it.
        _wait_for(tmp_path / "launch_0_rank0.log", first, 30, tmp_path, text=last_words)
    finally:
        _kill(first)
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", JOB_ID]
    saved = tmp_path / "out" / "run" / "hpc_ckpt_1.ckpt"
    manifest = verify(saved)  # a complete file, as its manifest says
    assert manifest["global_step"] >= 3
    assert decide_resume(None, extra=[saved]).value == str(saved)  # resume=auto ranks it with the others
    seen = json.loads((tmp_path / "out" / "seen0.json").read_text())
    first_log = (tmp_path / "launch_0_rank0.log").read_text()
    for rank in range(ntasks):
        (tmp_path / "out" / f"progress{rank}").unlink()
    second = _launch(tmp_path, ntasks, {**env, "SLURM_RESTART_COUNT": "1"})
    try:
        for proc in second:
            proc.wait(timeout=120)
    finally:
        _kill(second)
    assert all(p.returncode == 0 for p in second), _logs(tmp_path)
    for rank in range(ntasks):
        resumed = json.loads((tmp_path / "out" / f"seen{rank}.json").read_text())
        assert resumed["start"] == manifest["global_step"], "the requeued job resumes from the saved step"
        assert json.loads((tmp_path / "out" / f"end{rank}.json").read_text())["global_step"] == MAX_STEPS
    return {"seen": seen, "log": first_log, "manifest": manifest}


@pytest.mark.timeout(240)
def test_requeue_through_lightnings_handler(tmp_path):
    result = _requeue_then_resume(tmp_path, ntasks=1, env={}, signalled=[0])
    # Nothing else owned SIGUSR1: Lightning's handler did the work; SlurmRequeue stood aside.
    assert result["seen"]["lightning_owns"] is True
    assert result["seen"]["decisions"]["requeue"] == "lightning"
    assert result["manifest"]["trigger"] == "train"  # Lightning's trainer.save_checkpoint through SoloCheckpointIO


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_requeue_when_submitit_owns_the_signal(tmp_path):
    # submitit takes SIGUSR1 first (SUBMITIT_PREEMPT_SIGNAL=USR1), so Lightning installs no handler. Only rank 1
    # gets the signal: the ranks still save together, and rank 0 hands over to submitit, which requeues and exits.
    env = {"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "USR1"}
    result = _requeue_then_resume(tmp_path, ntasks=2, env=env, signalled=[1], last_words="Exiting gracefully")
    assert result["seen"]["lightning_owns"] is False
    assert result["seen"]["decisions"]["requeue"] == "solo"
    assert result["manifest"]["trigger"] == "requeue" and result["manifest"]["signal"] == "SIGUSR1"
    assert "Requeued job 4242" in result["log"] and "Exiting gracefully" in result["log"], "submitit's handler ran"
    assert (tmp_path / "out" / "submitit" / f"{JOB_ID}_submitted.pkl").exists(), "submitit checkpointed its task"


def test_submitit_launcher_config_composes():
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
            cfg = compose(
                "config",
                overrides=["hydra/launcher=slurm", "parallelism=slurm", "hydra.launcher.partition=gpu"],
                return_hydra_config=True,
            )
    finally:
        GlobalHydra.instance().clear()
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (1, 1, 1)
    assert launcher.cpus_per_task == 8 and launcher.timeout_min == 1440
    assert launcher.partition == "gpu" and launcher.signal_delay_s == 120 and launcher.max_num_timeout == 3
    assert launcher.gpus_per_task is None  # hydra#2231: gpus_per_node, never per task


def test_requeue_signal_choice(monkeypatch):
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_solo.callbacks import SlurmRequeue
    from lightning_solo.callbacks.requeue import requeue_signal

    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    environment = SLURMEnvironment(requeue_signal=signal.SIGUSR2)
    assert requeue_signal(environment) == signal.SIGUSR2  # the SLURM environment's
    assert requeue_signal(None) == signal.SIGUSR1 and requeue_signal(None, "USR2") == signal.SIGUSR2
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")  # inside a submitit job: submitit's signal
    assert requeue_signal(environment) == signal.SIGUSR2
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    assert requeue_signal(environment) == signal.SIGUSR1
    with pytest.raises(ValueError, match="check_every_n_steps"):
        SlurmRequeue(check_every_n_steps=0)
