"""Fault injection with real processes and real files.

* kill -9 of a 2-rank training run (the Lightning process and both ranks) while it checkpoints every
  step, over and over: ``last.ckpt`` must always verify and ``resume=auto`` must always resume;
* a damaged ``last.ckpt`` and a truncated newest checkpoint make auto-resume fall back to the one before;
* odd trials (and the run after the damage) resume with ``Trainer.fit(ckpt_path="auto")``, the others with
  the runner's ``resolve_ckpt_path("auto", ...)``;
* an exception on one rank ends the run promptly with that exception visible, and the exception-time
  save enters no collective;
* keep-last-k rotation, atomic ``last`` link, and never deleting the only good checkpoint.

The kill loop runs in a driver subprocess (``python tests/test_checkpoint_faults.py RUN_DIR TRIALS``)
that imports Lightning once and forks one training process per trial; it never runs a torch op itself,
so the forks are safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback

import lightning as L
import pytest
from torch import nn

from lightning_solo import SoloDDP
from lightning_solo.callbacks import SoloCheckpoint
from lightning_solo.checkpoint import (
    SoloCheckpointIO,
    decide_resume,
    read_manifest,
    resolve_ckpt_path,
    verify,
)
from lightning_solo.testing import free_port
from tests.helpers import SCRIPT_ENV, run_driver
from tests.helpers.modules import TinyModule

TRIALS = 20


class Wide(TinyModule):
    """Big enough (~1 MB of weights + momentum per checkpoint) that writes take a measurable share of a step;
    ``fail_rank`` raises at ``fail_step``."""

    def __init__(self, fail_rank: int | None = None, fail_step: int = 3) -> None:
        super().__init__((64, 1024, 64), activation=nn.ReLU, loss="square", samples=256, batch_size=8,
                         data_seed=0, shuffle=True, lr=1e-3, momentum=0.9)  # fmt: skip
        self.fail_rank, self.fail_step = fail_rank, fail_step

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and self.global_step == self.fail_step:
            raise ValueError(f"boom on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


def _trainer(ckpt_dir: str, max_steps: int, strategy=None, **ckpt_kwargs) -> L.Trainer:
    ckpt_kwargs.setdefault("every_n_train_steps", 1)
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy or SoloDDP(start_method="fork"),
        max_steps=max_steps,
        callbacks=[SoloCheckpoint(dirpath=ckpt_dir, **ckpt_kwargs)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


# ------------------------------------------------------------------------------------------------------------
# the kill -9 driver (runs in a subprocess)


def _step(path: str) -> int:
    manifest = read_manifest(path) if os.path.exists(path) else None
    return manifest["global_step"] if manifest else 0


def _temp_files(ckpt_dir: str) -> list[str]:
    return [n for n in os.listdir(ckpt_dir) if ".solo-tmp-" in n] if os.path.isdir(ckpt_dir) else []


class _RecordResume(L.Callback):
    """Rank 0 notes the checkpoint SoloDDP chose for ``fit(ckpt_path="auto")``, in the trials' one log (not a
    per-rank record: each trial appends the line the runner-path trials write too)."""

    def __init__(self, path: str, label: str) -> None:
        self.path, self.label = path, label

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            resumed = trainer.strategy.decisions["resume"].value
            with open(self.path, "a") as f:
                f.write(f"{self.label} {resumed} {_step(resumed) if resumed else 0}\n")


def _child_train(run_dir: str, max_steps: int, label: str, fit_auto: bool) -> None:
    """``fit_auto``: ``Trainer.fit(ckpt_path="auto")``; else the runner's way, ``resolve_ckpt_path`` first."""
    ckpt_dir, record = os.path.join(run_dir, "ckpt"), os.path.join(run_dir, "resumes.txt")
    trainer = _trainer(ckpt_dir, max_steps, keep_last_k=2)
    if fit_auto:
        trainer.callbacks.append(_RecordResume(record, label))
        return trainer.fit(Wide(), ckpt_path="auto")
    resumed = resolve_ckpt_path("auto", ckpt_dir)
    with open(record, "a") as f:
        f.write(f"{label} {resumed} {_step(resumed) if resumed else 0}\n")
    trainer.fit(Wide(), ckpt_path=resumed)


def _fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setpgid(0, 0)  # the training process and its ranks form one group: one killpg takes all
            fn(*args)
        except BaseException:  # noqa: BLE001 - report and exit with a code the driver checks
            traceback.print_exc()
            code = 1
        os._exit(code)
    with contextlib.suppress(OSError):  # the child may be gone already
        os.setpgid(pid, pid)  # also here, so that the group exists whichever process runs first
    return pid


def drive(run_dir: str, trials: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    ckpt_dir, last = os.path.join(run_dir, "ckpt"), os.path.join(run_dir, "ckpt", "last.ckpt")
    os.makedirs(run_dir, exist_ok=True)
    out = {
        "trials": 0,
        "killed_mid_write": 0,
        "killed_at_random": 0,
        "last_verified": 0,
        "resumed": 0,
        "steps": [],
        "errors": [],
    }
    for trial in range(trials):
        before = _step(last)
        pid = _fork(_child_train, run_dir, 100_000, f"trial{trial}", trial % 2 == 1)
        deadline = time.monotonic() + 60
        while _step(last) <= before:  # wait until this trial has trained and saved at least once
            if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() > deadline:
                out["errors"].append(f"trial {trial}: no progress past step {before}")
                break
            time.sleep(0.005)
        else:
            out["resumed"] += trial > 0
            if trial % 2:  # aim at the dangerous window: kill as soon as a write is in flight
                while not _temp_files(ckpt_dir) and time.monotonic() < deadline:
                    pass
                time.sleep(rng.uniform(0, 0.0005))
            else:
                time.sleep(rng.uniform(0, 0.25))
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        out["trials"] += 1
        if _temp_files(ckpt_dir):
            out["killed_mid_write"] += 1
        else:
            out["killed_at_random"] += 1
        try:
            out["steps"].append(verify(last)["global_step"])
            out["last_verified"] += 1
        except Exception as err:  # noqa: BLE001 - counted and reported
            out["errors"].append(f"trial {trial}: {err}")

    # A run that is left alone resumes, finishes, and cleans the temp files its killed predecessors left.
    final_step = _step(last) + 3
    pid = _fork(_child_train, run_dir, final_step, "final", False)
    out["final_exit"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    out["final_step"], out["final_target"] = _step(last), final_step
    out["temp_files_after_final"] = _temp_files(ckpt_dir)

    # Damage `last` and truncate the newest keep-last-k checkpoint: auto-resume must pass over both to the
    # one before, and train on.
    with open(last, "r+b") as f:
        f.seek(os.path.getsize(last) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    newest = next(os.path.join(ckpt_dir, n) for n in os.listdir(ckpt_dir) if n.endswith(f"-step={final_step}.ckpt"))
    os.truncate(newest, os.path.getsize(newest) // 2)
    out["fallback"] = decide_resume(ckpt_dir).as_dict()
    out["fallback_step"] = verify(out["fallback"]["value"])["global_step"] if out["fallback"]["value"] else None
    pid = _fork(_child_train, run_dir, final_step + 2, "after_damage", True)
    out["after_damage_exit"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    out["after_damage_step"] = _step(last)
    with open(os.path.join(run_dir, "resumes.txt")) as f:
        out["resumes"] = f.read().split("\n")[-3:-1]
    return out


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_kill9_while_checkpointing_last_always_verifies_and_resumes(tmp_path):
    out = run_driver(__file__, tmp_path, TRIALS, timeout=140)
    print(f"\nfault injection: {json.dumps({k: v for k, v in out.items() if k != 'steps'})}")
    assert out["errors"] == []
    assert out["trials"] == TRIALS and out["last_verified"] == TRIALS and out["resumed"] == TRIALS - 1
    assert out["killed_mid_write"] >= TRIALS // 4, "the kills never hit a write in flight"
    assert out["steps"] == sorted(out["steps"]) and out["steps"][-1] > out["steps"][0]
    assert out["final_exit"] == 0 and out["final_step"] == out["final_target"]
    assert out["temp_files_after_final"] == []
    fallback = out["fallback"]
    assert not fallback["value"].endswith("last.ckpt") and "last.ckpt: sha256 mismatch" in fallback["reason"]
    assert f"step={out['final_target']}.ckpt: the file does not end in a zip directory" in fallback["reason"]
    assert out["fallback_step"] == out["final_target"] - 1  # the keep-last-k checkpoint before the truncated one
    assert out["after_damage_exit"] == 0 and out["after_damage_step"] == out["final_target"] + 2
    assert out["resumes"][-1].split()[1] == fallback["value"]


# ------------------------------------------------------------------------------------------------------------
# exceptions on one rank


class _SpyDDP(SoloDDP):
    """Fails any collective made while a checkpoint callback handles an exception."""

    handling_exception = False

    def _guard(self, name: str) -> None:
        if _SpyDDP.handling_exception:
            raise AssertionError(f"collective {name} entered from on_exception")

    def barrier(self, *args, **kwargs):
        self._guard("barrier")
        return super().barrier(*args, **kwargs)

    def broadcast(self, *args, **kwargs):
        self._guard("broadcast")
        return super().broadcast(*args, **kwargs)

    def reduce_boolean_decision(self, *args, **kwargs):
        self._guard("reduce_boolean_decision")
        return super().reduce_boolean_decision(*args, **kwargs)

    def all_gather(self, *args, **kwargs):
        self._guard("all_gather")
        return super().all_gather(*args, **kwargs)


class _FlaggedCheckpoint(SoloCheckpoint):
    def on_exception(self, trainer, pl_module, exception):
        _SpyDDP.handling_exception = True
        super().on_exception(trainer, pl_module, exception)


def _exception_run(run_dir: str, fail_rank: int) -> None:
    # The popen launcher, as in scripts and the Hydra runner: each rank runs fit() itself, so each rank's
    # on_exception hooks run (the fork launcher only raises in the parent). A long process-group timeout
    # means any collective entered from one rank would outlast the test's time bound.
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_SpyDDP(start_method="popen", timeout=600),
        max_steps=20,
        callbacks=[_FlaggedCheckpoint(dirpath=run_dir, every_n_train_steps=10, save_on_exception=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Wide(fail_rank=fail_rank))


@pytest.mark.multiproc
@pytest.mark.cli
@pytest.mark.timeout(90)
def test_exception_on_one_rank_ends_the_run_promptly_and_enters_no_collective(tmp_path):
    # Two 2-rank runs side by side (they share nothing but the CPU): rank 1 fails in one, rank 0 in the other.
    start = time.monotonic()
    # Distinct rendezvous ports chosen here: two launchers picking "a free port" at the same moment can
    # collide and cross-wire the two runs.
    ports = {0: free_port(), 1: free_port()}
    while ports[1] == ports[0]:
        ports[1] = free_port()
    procs = {
        rank: subprocess.Popen(
            [sys.executable, __file__, "exception", str(tmp_path / f"fail{rank}"), str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**SCRIPT_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[rank])},
            start_new_session=True,
        )
        for rank in (0, 1)
    }
    try:
        stderr = {rank: proc.communicate(timeout=80)[1] for rank, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:  # a hang fails the test above; its ranks must not outlive it
                os.killpg(proc.pid, signal.SIGKILL)
    elapsed = time.monotonic() - start
    for rank, proc in procs.items():
        assert proc.returncode != 0
        assert f"ValueError: boom on rank {rank}" in stderr[rank], stderr[rank][-3000:]
        assert "entered from on_exception" not in stderr[rank]
    assert elapsed < 75  # nothing waited for the 10-minute process-group timeout

    # Rank 0 failed alone: it saved its local state, without a barrier, and not as `last`.
    manifest = verify(tmp_path / "fail0" / "on_exception.ckpt")
    assert manifest["trigger"] == "exception" and "boom on rank 0" in manifest["exception"]
    assert manifest["global_step"] == 3 and manifest["world_size"] == 2
    assert not (tmp_path / "fail0" / "last.ckpt").exists()
    decision = decide_resume(tmp_path / "fail0")
    assert decision.value is None and "written during an exception" in decision.reason


@pytest.mark.multiproc
def test_exception_on_one_rank_under_the_fork_launcher_ends_promptly(tmp_path):
    trainer = _trainer(str(tmp_path), 20, every_n_train_steps=10, save_on_exception=True)
    start = time.monotonic()
    with pytest.raises(Exception, match="boom on rank 1"):
        trainer.fit(Wide(fail_rank=1))
    assert time.monotonic() - start < 30


# ------------------------------------------------------------------------------------------------------------
# rotation


def _single(ckpt: SoloCheckpoint, max_steps: int) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[ckpt],
        plugins=[SoloCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModule())
    return trainer


def test_keep_last_k_rotates_and_never_deletes_the_only_good_checkpoint(tmp_path):
    trainer = _single(SoloCheckpoint(dirpath=tmp_path, every_n_train_steps=1, keep_last_k=2), 6)
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=5.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert all(verify(tmp_path / name) for name in os.listdir(tmp_path))
    assert verify(tmp_path / "last.ckpt")["global_step"] == 6

    # Its successor got damaged after the write: the rotation must keep the old one.
    callback = SoloCheckpoint(dirpath=tmp_path, keep_last_k=1)
    damaged = tmp_path / "epoch=0-step=6.ckpt"
    with open(damaged, "r+b") as f:
        f.truncate(100)
    callback._last_checkpoint_saved = str(damaged)
    with pytest.warns(UserWarning, match="keeping"):
        callback._remove_checkpoint(trainer, str(tmp_path / "epoch=0-step=5.ckpt"))
    assert (tmp_path / "epoch=0-step=5.ckpt").exists()
    callback._last_checkpoint_saved = str(tmp_path / "last.ckpt")
    callback._remove_checkpoint(trainer, str(tmp_path / "epoch=0-step=5.ckpt"))
    assert not (tmp_path / "epoch=0-step=5.ckpt").exists()


def test_last_link_is_replaced_atomically(tmp_path):
    _single(SoloCheckpoint(dirpath=tmp_path, every_n_train_steps=1, keep_last_k=1, save_last="link"), 4)
    assert os.path.islink(tmp_path / "last.ckpt")
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=0-step=4.ckpt"
    assert verify(tmp_path / "last.ckpt")["global_step"] == 4
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=4.ckpt", "last.ckpt"]


def test_bad_options_raise_value_error():
    with pytest.raises(ValueError, match="keep_last_k"):
        SoloCheckpoint(keep_last_k=0)
    with pytest.raises(ValueError, match="cannot be combined"):
        SoloCheckpoint(keep_last_k=2, monitor="val/acc")
    with pytest.raises(ValueError, match="save_last"):
        SoloCheckpoint(save_last="yes")
    with pytest.raises(ValueError, match="exception_save_timeout_s"):
        SoloCheckpoint(exception_save_timeout_s=0)


if __name__ == "__main__":
    if sys.argv[1] == "exception":
        _exception_run(sys.argv[2], int(sys.argv[3]))
    else:
        print(json.dumps(drive(sys.argv[1], int(sys.argv[2]))), flush=True)
