"""SoloCheckpointIO on real files: atomic same-directory writes, fsync, manifest, verification,
stale-temp cleanup, weights_only refusal, and newest-valid selection."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import zipfile

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_solo.checkpoint import (
    CheckpointVerificationError,
    SoloCheckpointIO,
    UnsafeCheckpointError,
    decide_resume,
    find_latest_valid,
    read_manifest,
    resolve_ckpt_path,
    verify,
)
from lightning_solo.ddp.resume import record as resume


def _ckpt(step: int, size: int = 64) -> dict:
    torch.manual_seed(step)
    return {"global_step": step, "epoch": step // 10, "state_dict": {"w": torch.randn(size, size)}}


class Opaque:  # a pickled Python object: weights_only=True must refuse it
    def __init__(self, x):
        self.x = x


def _flip_bit(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def test_roundtrip_manifest_and_plain_torch_compatibility(tmp_path):
    io = SoloCheckpointIO()
    path = tmp_path / "sub" / "a.ckpt"
    io.save_checkpoint(_ckpt(7), path)
    manifest = verify(path)
    assert manifest["global_step"] == 7 and manifest["epoch"] == 0 and manifest["world_size"] == 1
    assert manifest["trigger"] == "train"
    assert set(manifest["versions"]) == {"torch", "lightning", "lightning_solo", "python"}
    assert manifest == read_manifest(path)
    loaded = io.load_checkpoint(path)
    assert torch.equal(loaded["state_dict"]["w"], _ckpt(7)["state_dict"]["w"])
    # The manifest is the zip comment: plain torch.load and zipfile read the file as an ordinary checkpoint.
    assert torch.load(path, weights_only=True)["global_step"] == 7
    assert zipfile.ZipFile(path).testzip() is None
    assert os.listdir(path.parent) == ["a.ckpt"]


def test_write_is_same_directory_fsynced_and_independent_of_tmpdir(tmp_path, monkeypatch):
    # $TMPDIR unusable (another filesystem that is full, or gone): Lightning's writer, which stages through
    # it, fails; ours never touches it.
    monkeypatch.setenv("TMPDIR", str(tmp_path / "missing"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="missing"):
        TorchCheckpointIO().save_checkpoint(_ckpt(1), tmp_path / "stock.ckpt")

    replaced, synced = [], []
    real_replace, real_fsync = os.replace, os.fsync
    monkeypatch.setattr(os, "replace", lambda src, dst: (replaced.append((src, dst)), real_replace(src, dst))[1])
    monkeypatch.setattr(
        os, "fsync", lambda fd: (synced.append(os.path.realpath(f"/proc/self/fd/{fd}")), real_fsync(fd))[1]
    )
    target = tmp_path / "ckpts" / "last.ckpt"
    SoloCheckpointIO().save_checkpoint(_ckpt(1), target)
    ((src, dst),) = replaced
    assert os.path.dirname(src) == os.path.dirname(dst) == str(target.parent)
    assert os.path.basename(src).startswith(".last.ckpt.") and ".solo-tmp-" in os.path.basename(src)
    assert src in synced and str(target.parent) in synced  # the file, then the directory entry
    verify(target)


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    io = SoloCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(_ckpt(1), path)
    # torch.save's own error for an unpicklable object (AttributeError before Python 3.14, PicklingError after)
    with pytest.raises((pickle.PicklingError, AttributeError), match="Can't pickle"):
        io.save_checkpoint({"global_step": 2, "bad": lambda: None}, path)
    assert verify(path)["global_step"] == 1
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_stale_temp_files_are_cleaned_on_next_start(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    names = {
        "dead_here": f".last.ckpt.{dead.pid}@{host}.solo-tmp-abc123",
        "alive_here": f".last.ckpt.{os.getpid()}@{host}.solo-tmp-def456",
        "old_elsewhere": ".last.ckpt.1234@other.host.example.solo-tmp-x1",
        "new_elsewhere": ".last.ckpt.1234@other.host.example.solo-tmp-x2",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    old = time.time() - 7200
    os.utime(tmp_path / names["old_elsewhere"], (old, old))
    io = SoloCheckpointIO()
    io.save_checkpoint(_ckpt(1), tmp_path / "last.ckpt")
    left = set(os.listdir(tmp_path))
    assert left == {"last.ckpt", names["alive_here"], names["new_elsewhere"]}
    assert sorted(os.path.basename(p) for p in io.removed_temp_files) == sorted(
        [names["dead_here"], names["old_elsewhere"]]
    )
    assert find_latest_valid(tmp_path) == str(tmp_path / "last.ckpt")  # temp files are never candidates


def test_truncated_and_bit_flipped_files_are_rejected_naming_the_file(tmp_path):
    io = SoloCheckpointIO()
    paths = [tmp_path / f"step={s}.ckpt" for s in (1, 2, 3, 4)]
    for step, path in zip((1, 2, 3, 4), paths):
        io.save_checkpoint(_ckpt(step), path)
    size = os.path.getsize(paths[3])
    with open(paths[3], "r+b") as f:  # a writer killed half-way, without the atomic rename
        f.truncate(size // 2)
    _flip_bit(paths[2], os.path.getsize(paths[2]) // 2)  # payload bit rot
    manifest_start = os.path.getsize(paths[1]) - 40
    _flip_bit(paths[1], manifest_start)  # bit rot inside the manifest itself

    for path, reason in ((paths[3], "truncated"), (paths[2], "sha256 mismatch"), (paths[1], "manifest")):
        with pytest.raises(CheckpointVerificationError, match=reason) as err:
            verify(path)
        assert str(path) in str(err.value)
        with pytest.raises(CheckpointVerificationError) as err:
            io.load_checkpoint(path)
        assert str(path) in str(err.value)

    decision = decide_resume(tmp_path)
    assert decision.value == str(paths[0])
    for bad in paths[1:]:
        assert bad.name in decision.reason
    assert resolve_ckpt_path("auto", tmp_path) == str(paths[0])
    paths[0].write_bytes(b"")
    assert resolve_ckpt_path("auto", tmp_path) is None
    assert resolve_ckpt_path(None, tmp_path) is None
    assert resolve_ckpt_path("some/explicit.ckpt", tmp_path) == "some/explicit.ckpt"
    assert decide_resume(tmp_path / "nowhere").value is None


def test_newest_by_step_and_exception_checkpoints_are_opt_in(tmp_path):
    io = SoloCheckpointIO()
    io.save_checkpoint(_ckpt(5), tmp_path / "b.ckpt")
    io.save_checkpoint(_ckpt(9), tmp_path / "a.ckpt")  # name order and write order disagree with step order
    io.save_checkpoint(_ckpt(3), tmp_path / "c.ckpt")
    io.save_checkpoint(_ckpt(12), tmp_path / "on_exception.ckpt", storage_options={"trigger": "exception"})
    torch.save(_ckpt(20), tmp_path / "stock.ckpt")  # no manifest: cannot be verified
    decision = decide_resume(tmp_path)
    assert decision.value == str(tmp_path / "a.ckpt")
    assert "on_exception.ckpt: written during an exception" in decision.reason
    assert "stock.ckpt" in decision.reason
    assert find_latest_valid(tmp_path, include_exception=True) == str(tmp_path / "on_exception.ckpt")


def test_weights_only_refuses_pickled_objects_with_an_explanation(tmp_path):
    path = tmp_path / "opaque.ckpt"
    SoloCheckpointIO().save_checkpoint({"global_step": 1, "hyper_parameters": {"obj": Opaque(3)}}, path)
    with pytest.raises(UnsafeCheckpointError, match="weights_only=False") as err:
        SoloCheckpointIO().load_checkpoint(path)
    assert str(path) in str(err.value)
    assert SoloCheckpointIO().load_checkpoint(path, weights_only=False)["hyper_parameters"]["obj"].x == 3
    assert SoloCheckpointIO(weights_only=False).load_checkpoint(path)["hyper_parameters"]["obj"].x == 3


def test_training_states_load_with_weights_only(tmp_path):
    # What an exact resume carries must pass weights_only=True: optimizer, scheduler, GradScaler,
    # PowerSGD-style compression state, and every rank's RNG states.
    import random

    import numpy as np

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    powersgd = {
        "iter": 7,
        "rng": torch.get_rng_state(),
        "error_dict": {0: torch.randn(8)},
        "p_memory_dict": {},
    }
    rng = resume.rng_state()
    draws = (torch.rand(3), np.random.rand(), random.random())
    ckpt = {
        "global_step": 3,
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
        "MixedPrecision": scaler.state_dict(),
        "powersgd": powersgd,
        resume.RESUME_KEY: {"rng": [resume.rng_state(), rng], "epoch": 1},
    }
    SoloCheckpointIO().save_checkpoint(ckpt, tmp_path / "s.ckpt")
    loaded = SoloCheckpointIO().load_checkpoint(tmp_path / "s.ckpt")
    assert loaded["MixedPrecision"]["scale"] == 1024.0
    assert loaded["powersgd"]["iter"] == 7
    assert torch.equal(loaded["powersgd"]["error_dict"][0], powersgd["error_dict"][0])
    assert torch.equal(
        loaded["optimizer_states"][0]["state"][0]["momentum_buffer"],
        opt.state[model.weight]["momentum_buffer"],
    )
    assert loaded["lr_schedulers"][0] == sched.state_dict()
    resume.set_rng_state(loaded[resume.RESUME_KEY]["rng"][1])
    again = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]


def test_manifest_less_checkpoints_load_with_a_warning_unless_required(tmp_path):
    path = tmp_path / "stock.ckpt"
    torch.save(_ckpt(2), path)
    with pytest.warns(UserWarning, match="no lightning_solo manifest"):
        assert SoloCheckpointIO().load_checkpoint(path)["global_step"] == 2
    with pytest.raises(CheckpointVerificationError, match="no lightning_solo manifest"):
        SoloCheckpointIO(require_manifest=True).load_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        SoloCheckpointIO().load_checkpoint(tmp_path / "missing.ckpt")


def test_bad_options_raise_value_error():
    with pytest.raises(ValueError, match="weights_only must be True or False"):
        SoloCheckpointIO(weights_only="yes")
    with pytest.raises(TypeError, match="storage_options"):
        SoloCheckpointIO().save_checkpoint({}, "/tmp/x.ckpt", storage_options="s3")


def test_file_mode_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        SoloCheckpointIO().save_checkpoint(_ckpt(1), tmp_path / "a.ckpt")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "a.ckpt").st_mode & 0o777 == 0o644  # group and others can read it


def test_stock_and_legacy_format_checkpoints_load_with_a_warning(tmp_path):
    import lightning as L

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer.fit(BoringModel())
    trainer.save_checkpoint(tmp_path / "stock.ckpt")  # Lightning's own TorchCheckpointIO
    torch.save(_ckpt(3), tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    for name, key in (("stock.ckpt", "state_dict"), ("legacy.ckpt", "global_step")):
        with pytest.warns(UserWarning, match="loading it unverified"):
            assert key in SoloCheckpointIO().load_checkpoint(tmp_path / name)
    with open(tmp_path / "legacy.ckpt", "r+b") as f:  # a damaged zip checkpoint is still refused
        f.truncate(10)
    SoloCheckpointIO().save_checkpoint(_ckpt(3), tmp_path / "cut.ckpt")
    with open(tmp_path / "cut.ckpt", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "cut.ckpt") // 2)
    for name in ("legacy.ckpt", "cut.ckpt"):
        with pytest.raises(CheckpointVerificationError, match="truncated"):
            SoloCheckpointIO().load_checkpoint(tmp_path / name)


def test_crash_order_file_fsync_then_rename_then_directory_fsync(tmp_path, monkeypatch):
    """The kill -9 tests cannot see fsync (the page cache survives SIGKILL): record the real calls instead. A
    power loss is survived only if the data is on disk before the rename, and the rename before we go on."""
    import stat

    from lightning_solo.callbacks import SoloCheckpoint

    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        calls.append((f"fsync_{kind}", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        calls.append(("rename", os.fspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = str(tmp_path / "a.ckpt")
    SoloCheckpointIO().save_checkpoint(_ckpt(1), target)
    kinds = [kind for kind, _ in calls]
    assert kinds == ["fsync_file", "rename", "fsync_dir"], calls
    assert ".solo-tmp-" in calls[0][1] and calls[1][1] == target and calls[2][1] == str(tmp_path)

    # The atomic `last` link swap: a rename of the new link, then the directory.
    calls.clear()

    class _Trainer:
        is_global_zero = True
        strategy = type("S", (), {"barrier": staticmethod(lambda *a, **k: None)})()

    SoloCheckpoint()._link_checkpoint(_Trainer(), target, str(tmp_path / "last.ckpt"))
    assert calls == [("rename", str(tmp_path / "last.ckpt")), ("fsync_dir", str(tmp_path))]
    assert os.readlink(tmp_path / "last.ckpt") == "a.ckpt"
