"""SoloCheckpoint(async_save=True): the background write holds exactly the saved step, commits like a synchronous
one, and loses nothing at the edges.

* 2 gloo ranks, a slow write: every async checkpoint equals the synchronous run's of the same step, tensor for
  tensor, although training ran on during the write; the waits are measured; the fit's end waits;
* resume from an async checkpoint (loader workers, augmentation, in-epoch validation) equals the uninterrupted run;
* kill -9 at random moments during slow background writes (a driver subprocess forks the training process, as in
  test_checkpoint_faults.py): the newest committed checkpoint always verifies and loads, a complete temp file is
  never chosen;
* an exception on one rank while rank 0 writes: the newest committed checkpoint is valid;
* a SIGTERM stop, a SLURM requeue and a notebook's two fits (2 gloo ranks each, the write made slow) each wait for
  the write in flight; the watchdog, its thresholds below the write's time, reports nothing while a rank waits;
* rotation only after the commit, a failed background write raised and nothing rotated past it, the fit's end
  bounded by ``async_timeout_s``; the host staging keeps views shared and holds one snapshot.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

import lightning as L
import pytest
import torch

from lightning_solo import SoloDDP
from lightning_solo.callbacks import SoloCheckpoint
from lightning_solo.checkpoint import (
    SoloCheckpointIO,
    decide_resume,
    read_manifest,
    resolve_ckpt_path,
    verify,
)
from lightning_solo.checkpoint.background import HostStaging, decide_async_save
from tests.helpers import REPO, SCRIPT_ENV, run_driver
from tests.helpers.modules import TinyModule


class SlowIO(SoloCheckpointIO):
    """A slow disk: each file's write starts ``delay_s`` late (on the background thread when async)."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False, block: threading.Event | None = None) -> None:
        super().__init__()
        self.delay_s, self.fail, self.block = delay_s, fail, block
        self.seen: list[tuple[str, list[str]]] = []  # (file, the directory when its write began)

    def write_file(self, checkpoint, path, manifest):
        self.seen.append((os.path.basename(path), sorted(os.listdir(os.path.dirname(path)))))
        time.sleep(self.delay_s)
        if self.block is not None:
            self.block.wait(10)
        if self.fail and len(self.seen) > 2:  # step 1's two files are written
            raise OSError("No space left on device (simulated)")
        super().write_file(checkpoint, path, manifest)


def _same(a: Any, b: Any, where: str = "") -> None:
    """``a`` equals ``b`` exactly: tensors bit for bit (dtype, shape, values), everything else by ``==``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for key in a:
            _same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(a, "shape") and hasattr(a, "dtype"):  # numpy arrays (the numpy RNG state)
        assert (a == b).all(), where
    else:
        assert a == b, (where, a, b)


# ------------------------------------------------------------------------------------------------------------
# 2 ranks: async ≡ sync for every saved step, while training runs on during the write


class Net(TinyModule):
    """Dropout (RNG), momentum, a step LR schedule, shuffled data: every piece of state a step changes."""

    def __init__(self) -> None:
        step_lr = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # noqa: E731
        super().__init__((16, 256, 4), dropout=0.2, loss="square", samples=96, batch_size=4, data_seed=0,
                         shuffle=True, lr=0.05, momentum=0.9, scheduler=step_lr)  # fmt: skip


def _fit_ddp(ckpt_dir: str, async_save: bool, delay_s: float, max_steps: int = 8) -> SoloCheckpoint:
    L.seed_everything(7, verbose=False)
    callback = SoloCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, keep_last_k=2, async_save=async_save)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(start_method="fork", checkpoint_io=SlowIO(delay_s)),
        max_steps=max_steps,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.dirname(ckpt_dir),  # what a failing rank's watchdog writes
        num_sanity_val_steps=0,
    )
    trainer.fit(Net())
    return callback


def _load(path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


def _with_dir(obj: Any, old: str, new: str) -> Any:
    if isinstance(obj, str):
        return obj.replace(old, new)
    if isinstance(obj, dict):
        return {_with_dir(k, old, new): _with_dir(v, old, new) for k, v in obj.items()}
    return obj


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_async_checkpoints_equal_sync_ones_of_the_same_step(tmp_path):
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    _fit_ddp(sync_dir, async_save=False, delay_s=0.0)
    # Each write starts 0.4 s late: the ranks train on through the next steps while it runs.
    callback = _fit_ddp(async_dir, async_save=True, delay_s=0.4)

    # The fit's end waited for the last write; rotation ran after each commit.
    names = ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    assert sorted(os.listdir(async_dir)) == sorted(os.listdir(sync_dir)) == names
    assert verify(os.path.join(async_dir, "last.ckpt"))["global_step"] == 8
    for name in names:
        expected, got = _load(os.path.join(sync_dir, name)), _load(os.path.join(async_dir, name))
        assert got["global_step"] == expected["global_step"]
        for key in expected:  # weights, optimizer, schedulers, loops, resume record (RNGs, loader positions)
            _same(_with_dir(got[key], async_dir, sync_dir), expected[key], f"{name}:{key}")
    # ... and a checkpoint of a later step differs: the comparison would see a leak.
    step6, step8 = (_load(os.path.join(async_dir, n))["state_dict"] for n in names[:2])
    with pytest.raises(AssertionError):
        _same(step6, step8)

    stats = callback.decisions["async_save_waits"].value
    assert stats["saves"] == 4 and stats["waits"] >= 3  # saves 2 steps apart, writes 0.4 s: each waited
    assert stats["wait_s_max"] > 0.1 and stats["staged_bytes_max"] > 16 * 256 * 4  # weights + momentum
    assert callback.decisions["async_save"].value is True


# ------------------------------------------------------------------------------------------------------------
# resume from an async checkpoint ≡ the uninterrupted run


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_resume_from_an_async_checkpoint_is_exact(tmp_path):
    """test_resume.py's run: loader workers, augmentation from three RNGs, validation twice per epoch where the
    checkpoint is written (in the background), a crash, ``fit(ckpt_path="auto")``: weights end bit-identical."""
    from tests.test_resume import _resumed_equals_reference

    decisions = _resumed_equals_reference(
        tmp_path, checkpoint=lambda d: SoloCheckpoint(dirpath=d, keep_last_k=1, async_save=True)
    )
    assert decisions["mid_epoch_resume"]["value"] == 3
    assert decisions["resume"]["value"].endswith("last.ckpt")


# ------------------------------------------------------------------------------------------------------------
# kill -9 during background writes (the driver runs in a subprocess)


def _temp_files(ckpt_dir: str) -> list[str]:
    return [n for n in os.listdir(ckpt_dir) if ".solo-tmp-" in n] if os.path.isdir(ckpt_dir) else []


def _step(path: str) -> int:
    manifest = read_manifest(path) if os.path.exists(path) else None
    return manifest["global_step"] if manifest else 0


def _child_train(ckpt_dir: str, seed: int) -> None:
    rng = random.Random(seed)
    real_fsync = os.fsync

    def slow_fsync(fd):  # the file is complete, manifest included, but not yet renamed into place
        time.sleep(rng.uniform(0.0, 0.15))
        real_fsync(fd)

    os.fsync = slow_fsync
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=100_000,
        callbacks=[SoloCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, keep_last_k=2, async_save=True)],
        plugins=[SlowIO(delay_s=0.05)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.dirname(ckpt_dir),  # what a failing rank's watchdog writes
    )
    model = TinyModule((64, 512, 64), loss="square", samples=1024, batch_size=8, momentum=0.9)
    trainer.fit(model, ckpt_path=resolve_ckpt_path("auto", ckpt_dir))


def drive(run_dir: str, trials: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    ckpt_dir = os.path.join(run_dir, "ckpt")
    os.makedirs(run_dir, exist_ok=True)
    out: dict[str, Any] = {"trials": 0, "killed_mid_write": 0, "complete_temp": 0, "ok": 0, "steps": []}
    out["errors"] = []
    for trial in range(trials):
        before = _step(os.path.join(ckpt_dir, "last.ckpt"))
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child_train(ckpt_dir, seed + trial)
            except BaseException:  # noqa: BLE001 - reported through the exit code
                traceback.print_exc()
                code = 1
            os._exit(code)
        deadline = time.monotonic() + 60
        while _step(os.path.join(ckpt_dir, "last.ckpt")) <= before:  # this trial has committed a save
            if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() > deadline:
                out["errors"].append(f"trial {trial}: no progress past step {before}")
                break
            time.sleep(0.005)
        if trial % 2:  # aim at a background write: kill while its temp file exists
            while not _temp_files(ckpt_dir) and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.05))
        else:
            time.sleep(rng.uniform(0.0, 0.4))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        out["trials"] += 1
        temps = _temp_files(ckpt_dir)
        out["killed_mid_write"] += bool(temps)
        out["complete_temp"] += any(read_manifest(os.path.join(ckpt_dir, t)) for t in temps)
        decision = decide_resume(ckpt_dir)
        try:
            chosen = decision.value
            assert chosen is not None and ".solo-tmp-" not in chosen, decision
            manifest = verify(chosen)
            assert torch.load(chosen, weights_only=True)["global_step"] == manifest["global_step"]
            # the newest committed: no committed file in the directory has a later step
            committed = [n for n in os.listdir(ckpt_dir) if n.endswith(".ckpt") and ".solo-tmp-" not in n]
            assert manifest["global_step"] == max(verify(os.path.join(ckpt_dir, n))["global_step"] for n in committed)
            out["steps"].append(manifest["global_step"])
            out["ok"] += 1
        except Exception as err:  # noqa: BLE001 - counted and reported
            out["errors"].append(f"trial {trial}: {err!r}")
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_kill9_during_background_writes_leaves_the_newest_committed_checkpoint(tmp_path):
    trials = 10
    out = run_driver(__file__, tmp_path, trials, timeout=110)
    print(f"\nasync kill -9: {json.dumps(out)}")
    assert out["errors"] == [] and out["trials"] == trials and out["ok"] == trials
    assert out["killed_mid_write"] >= trials // 4, "the kills never hit a background write"
    assert out["complete_temp"] >= 1  # a complete file with its manifest, not renamed yet: never chosen
    assert out["steps"] == sorted(out["steps"]) and out["steps"][-1] > out["steps"][0]  # each trial resumed


# ------------------------------------------------------------------------------------------------------------
# an exception on one rank while rank 0 writes


class Failing(TinyModule):
    def __init__(self) -> None:
        super().__init__((64, 512, 64), loss="square", samples=256, batch_size=8, data_seed=0, momentum=0.9)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            raise ValueError("boom on rank 1")
        return super().training_step(batch, batch_idx)


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_exception_on_one_rank_during_a_background_write_keeps_the_newest_committed_valid(tmp_path):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(start_method="fork", checkpoint_io=SlowIO(delay_s=0.5)),
        max_steps=20,
        callbacks=[SoloCheckpoint(dirpath=tmp_path, every_n_train_steps=1, keep_last_k=2, async_save=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,  # what a failing rank's watchdog writes
    )
    start = time.monotonic()
    with pytest.raises(Exception, match="boom on rank 1"):
        trainer.fit(Failing())  # rank 1 fails at step 3, while rank 0 writes step 2's checkpoint
    assert time.monotonic() - start < 60
    chosen = decide_resume(tmp_path).value
    assert chosen is not None and ".solo-tmp-" not in chosen
    assert verify(chosen)["global_step"] in (1, 2, 3)
    assert torch.load(chosen, weights_only=True)["state_dict"].keys()


# ------------------------------------------------------------------------------------------------------------
# the stops that end a fit early wait for the write in flight: SIGTERM, a SLURM requeue, a notebook's fits


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_a_sigterm_stop_waits_for_the_write_in_flight(tmp_path):
    # 2 ranks (popen launcher), a save every 2 steps, each write 2 s; rank 1 gets SIGTERM at step 5, while a write is
    # in flight; the ranks stop together a step or two later.
    script = REPO / "tests" / "scripts" / "async_sigterm_fit.py"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=SCRIPT_ENV, capture_output=True,
                          text=True, timeout=140)  # fmt: skip
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["ended"] in ("SIGTERMException", "SystemExit"), (result, proc.stderr[-3000:])
    manifest = verify(tmp_path / "ckpt" / "on_sigterm.ckpt")
    stop = manifest["global_step"]
    assert manifest["trigger"] == "sigterm" and stop >= 5
    # Right after the fit: every save up to the stop committed (the last one was in flight), none cut off mid-write.
    saves = [f"epoch=0-step={step}.ckpt" for step in range(2, stop + 1, 2)]
    assert result["listing"] == sorted([*saves, "on_sigterm.ckpt"]), result["listing"]
    assert (
        torch.load(tmp_path / "ckpt" / saves[-1], weights_only=True)["global_step"]
        == verify(tmp_path / "ckpt" / saves[-1])["global_step"]
        == 2 * (stop // 2)
    )


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_slurm_requeue_waits_for_the_write_in_flight(tmp_path):
    from tests.test_slurm import _kill, _launch, _wait_for

    # 2 tasks of a SLURM job, a save every 2 steps written 3 s: a write is in flight when rank 1 gets the signal.
    # The stub scontrol lists the checkpoint directory when SlurmRequeue calls it (SLURM ends the job then).
    ckpt_dir, listing = tmp_path / "out" / "ckpt", tmp_path / "listing"
    (tmp_path / "bin").mkdir()
    stub = tmp_path / "bin" / "scontrol"
    stub.write_text(f'#!/bin/sh\nls -a {ckpt_dir} > {listing}\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    stub.chmod(0o755)
    (tmp_path / "out").mkdir()
    procs = _launch(tmp_path, 2, {"SLOW_STEPS": "1", "ASYNC_CKPT": "1", "REQUEUE_SIGNAL": "SIGUSR2"})
    try:
        for rank in range(2):
            _wait_for(tmp_path / "out" / f"progress{rank}", procs, 120, tmp_path)
        os.kill(procs[1].pid, signal.SIGUSR2)
        _wait_for(tmp_path / "scontrol.log", procs, 90, tmp_path)
    finally:
        _kill(procs)  # as SLURM does on a requeue
    step = verify(tmp_path / "out" / "run" / "hpc_ckpt_1.ckpt")["global_step"]
    newest = 2 * ((step - 1) // 2)  # the save before the requeue's step: its write began at most 2 steps earlier
    names = listing.read_text().split()
    assert f"epoch=0-step={newest}.ckpt" in names and not [n for n in names if ".solo-tmp-" in n], names
    assert verify(ckpt_dir / f"epoch=0-step={newest}.ckpt")["global_step"] == newest


def _notebook_fit(ckpt_dir, max_steps: int) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(start_method="fork", checkpoint_io=SlowIO(delay_s=1.5)),
        max_steps=max_steps,
        callbacks=[SoloCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, keep_last_k=2, async_save=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.dirname(ckpt_dir),
    )
    trainer.fit(TinyModule(samples=256), ckpt_path=resolve_ckpt_path("auto", ckpt_dir))


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_notebooks_fits_each_wait_for_their_last_write(tmp_path):
    # A parent that fits twice with forked ranks (a notebook's way): each fit returns once its last write committed,
    # and the second resumes from the first's.
    ckpt_dir = str(tmp_path / "ckpt")
    _notebook_fit(ckpt_dir, 4)
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert verify(os.path.join(ckpt_dir, "last.ckpt"))["global_step"] == 4
    _notebook_fit(ckpt_dir, 8)
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    assert torch.load(os.path.join(ckpt_dir, "last.ckpt"), weights_only=True)["global_step"] == 8


# ------------------------------------------------------------------------------------------------------------
# the watchdog: a rank waiting for its own background write is at work, not stalled


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_the_watchdog_takes_a_wait_for_a_background_write_as_work(tmp_path):
    # Each write 6 s, the watchdog's allowances 1-3 s: the save at step 6 waits for step 3's write (rank 1 waits in
    # the save's barrier meanwhile), the fit's end for step 6's. Before, that wait was reported as rank 0 "in
    # on_train_batch_end" past its allowance.
    watchdog = {"factor": 2.0, "margin_s": 1.0, "first_s": 3.0, "interval_s": 0.2}
    callback = SoloCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, keep_last_k=2, async_save=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(start_method="fork", checkpoint_io=SlowIO(delay_s=6.0), watchdog=watchdog),
        max_steps=7,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,  # where the watchdog writes its reports
    )
    start = time.monotonic()
    trainer.fit(TinyModule(samples=256))
    assert time.monotonic() - start > 12  # both waits happened
    assert not (tmp_path / "hang").exists(), (tmp_path / "hang" / "reports.txt").read_text()
    assert verify(tmp_path / "ckpt" / "last.ckpt")["global_step"] == 7  # the fit's end waited for its write
    assert trainer.strategy.decisions["watchdog"].value


# ------------------------------------------------------------------------------------------------------------
# one process: commit order, failures, the end's timeout, the staging


def _single(tmp_path, io: SoloCheckpointIO, max_steps: int = 4, **kwargs) -> tuple[L.Trainer, SoloCheckpoint]:
    callback = SoloCheckpoint(dirpath=tmp_path, every_n_train_steps=1, keep_last_k=1, async_save=True, **kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[callback],
        plugins=[io],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,  # what a failing rank's watchdog writes
    )
    trainer.fit(TinyModule())
    return trainer, callback


def test_rotation_and_last_link_move_only_after_the_commit(tmp_path):
    io = SlowIO(delay_s=0.05)
    _single(tmp_path, io, save_last="link")
    # When step n's file began its (background) write, step n-1's file and the link to it were still there.
    for n in range(2, 5):
        listing = dict(io.seen)[f"epoch=0-step={n}.ckpt"]
        assert f"epoch=0-step={n - 1}.ckpt" in listing and "last.ckpt" in listing
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=0-step=4.ckpt"


def test_a_failed_background_write_is_raised_and_nothing_is_rotated_past_it(tmp_path):
    with pytest.raises(RuntimeError, match=r"background checkpoint write .* failed: No space left"):
        _single(tmp_path, SlowIO(fail=True))
    # The only good checkpoint (step 1) stays, and `last` is step 1's.
    assert verify(tmp_path / "epoch=0-step=1.ckpt")["global_step"] == 1
    assert verify(tmp_path / "last.ckpt")["global_step"] == 1
    assert verify(decide_resume(tmp_path).value)["global_step"] == 1


def test_the_fits_end_waits_at_most_async_timeout_s(tmp_path, caplog):
    block = threading.Event()
    start = time.monotonic()
    with caplog.at_level(logging.ERROR):
        _single(tmp_path, SlowIO(block=block), max_steps=1, async_timeout_s=0.5)
    assert time.monotonic() - start < 8
    assert "did not finish within async_timeout_s" in caplog.text
    block.set()  # the write goes on and commits; nothing else was queued behind it
    for thread in threading.enumerate():
        if thread.name == "solo-checkpoint-writer":
            thread.join(10)
    assert verify(tmp_path / "epoch=0-step=1.ckpt")["global_step"] == 1


def test_select_never_picks_an_uncommitted_file(tmp_path):
    io = SoloCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, str(tmp_path / "step1.ckpt"))
    # A complete file, manifest and all, that was never renamed into place (killed before os.replace).
    io.save_checkpoint({"global_step": 9, "w": torch.ones(2)}, str(tmp_path / "x.ckpt"))
    temp = tmp_path / f".last.ckpt.{os.getpid()}@{os.uname().nodename}.solo-tmp-abc"
    shutil.move(tmp_path / "x.ckpt", temp)
    assert verify(temp)["global_step"] == 9
    assert decide_resume(tmp_path).value == str(tmp_path / "step1.ckpt")


def test_host_staging_keeps_views_shared_and_holds_one_snapshot():
    base = torch.arange(12.0)
    state = {"w": base, "view": base[2:8:2], "same": base, "nested": [(torch.ones(3), 1.5)], "n": 3}
    staging = HostStaging()
    snap = staging.snapshot(state)
    base.add_(100)  # training goes on: the snapshot keeps the saved values
    assert torch.equal(snap["w"], torch.arange(12.0)) and snap["view"].tolist() == [2.0, 4.0, 6.0]
    assert (
        snap["same"] is snap["w"]
        and snap["view"].untyped_storage().data_ptr() == snap["w"].untyped_storage().data_ptr()
    )
    assert snap["nested"][0][1] == 1.5 and snap["n"] == 3
    first = staging.nbytes
    assert first == 12 * 4 + 3 * 4
    staging.close_group()
    staging.release()
    again = staging.snapshot(state)  # the next save refills the same buffers
    assert staging.nbytes == first
    assert again["w"].untyped_storage().data_ptr() == snap["w"].untyped_storage().data_ptr()
    assert torch.equal(again["w"], base)


@pytest.mark.parametrize(
    ("save_s", "step_s", "value"),
    [(5.0, 0.1, True), (0.21, 0.1, True), (0.2, 0.1, False), (0.05, 0.1, False)],
)
def test_decide_async_save_goes_background_past_two_steps(save_s, step_s, value):
    decision = decide_async_save(save_s, step_s)
    assert decision.value is value and "auto" in decision.reason


class SlowStep(TinyModule):
    def training_step(self, batch, batch_idx):
        time.sleep(0.1)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("model", "delay_s", "value"), [(TinyModule, 0.3, True), (SlowStep, 0.0, False)])
def test_async_save_auto_times_the_first_save(tmp_path, model, delay_s, value):
    callback = SoloCheckpoint(dirpath=tmp_path, every_n_train_steps=3, keep_last_k=1, async_save="auto")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=9,
        callbacks=[callback],
        plugins=[SlowIO(delay_s)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,  # what a failing rank's watchdog writes
    )
    trainer.fit(model())
    assert callback.decisions["async_save"].value is value
    assert ("async_save_waits" in callback.decisions) is value  # later saves went through the writer
    assert sorted(os.listdir(tmp_path)) == ["epoch=1-step=9.ckpt", "last.ckpt"]  # rotated after the commit
    assert verify(tmp_path / "last.ckpt")["global_step"] == 9


class RaisesAtStep3(TinyModule):
    def training_step(self, batch, batch_idx):
        if self.global_step == 3:
            raise ValueError("boom at step 3")
        return super().training_step(batch, batch_idx)


def test_an_exception_waits_for_the_write_in_flight(tmp_path):
    callback = SoloCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=False, async_save=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=10,
        callbacks=[callback],
        plugins=[SlowIO(delay_s=0.5)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,  # what a failing rank's watchdog writes
    )
    with pytest.raises(ValueError, match="boom at step 3"):
        trainer.fit(RaisesAtStep3())  # raises while step 3's checkpoint is still being written
    assert verify(tmp_path / "epoch=0-step=3.ckpt")["global_step"] == 3  # on_exception waited for it
    assert callback.decisions["async_save_waits"].value["waits"] >= 1


if __name__ == "__main__":
    print(json.dumps(drive(sys.argv[1], int(sys.argv[2]))))
