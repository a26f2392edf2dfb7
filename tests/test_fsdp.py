"""parallelism=fsdp: SoloFSDP (torch's FSDP2) trains on CPU with gloo in 2 real processes, with WarmupScaledLR and
SoloCheckpoint; its sharded checkpoints verify, resume, and consolidate into a file a plain model loads with
weights_only=True; an exception on one rank during a background write leaves the newest committed one; bf16
FSDP (fp32 BatchNorm) trains there too and agrees with fp32 FSDP and SoloDDP."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from lightning_solo.app.config_check import check_config
from lightning_solo.app.data import DigitsDataModule
from lightning_solo.app.models import SmallCNN
from lightning_solo.checkpoint import decide_resume, resolve_ckpt_path
from lightning_solo.checkpoint.manifest import CheckpointVerificationError
from lightning_solo.checkpoint.sharded import save_sharded, verify_sharded
from lightning_solo.fsdp.consolidate import consolidate
from lightning_solo.fsdp.consolidate import main as consolidate_main
from lightning_solo.fsdp.strategy import (
    SoloFSDP,
    decide_bn_precision,
    decide_bn_stats,
    decide_fsdp_precision,
    decide_wrap,
    group_policy_for,
)
from tests.helpers import REPO, SCRIPT_ENV, composed, run_cli


class Holder(nn.Module):  # stands for a LightningModule: the strategy shards its children
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 20), nn.Sequential(nn.Linear(20, 20), nn.Linear(20, 2)))
        self.head = nn.Linear(2, 2)


def test_wrap_policy_by_size_and_by_class():
    module = Holder()
    groups, decision = decide_wrap(module, None, min_num_params=400)
    # Linear(20, 20) has 420 parameters: its own group; the rest of `body` (262 + 42) and `head` close the list.
    assert groups == [module.body[1][0], module.body, module.head] and decision.value == 3
    groups, _ = decide_wrap(module, ["Linear"], min_num_params=1)
    assert groups == [module.body[0], module.body[1][0], module.body[1][1], module.head, module.body]
    module.extra = nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match="holds parameters itself"):
        decide_wrap(module, None, 400)


def test_precision_policy():
    policy, decision = decide_fsdp_precision("auto", torch.device("cpu"))
    assert policy is None and decision.value == "32-true"
    policy, decision = decide_fsdp_precision("bf16-mixed", torch.device("cpu"))
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert policy.output_dtype == torch.float32  # logits, hence the loss, stay fp32
    # "auto" on GPUs: bf16 only when every rank has it natively (the levels SoloDDP's precision rule agrees).
    cuda = torch.device("cuda", 0)
    assert decide_fsdp_precision("auto", cuda, levels=[2, 2])[1].value == "bf16-mixed"
    assert decide_fsdp_precision("auto", cuda, levels=[2, 1])[1].value == "32-true"
    with pytest.raises(ValueError, match="precision must be"):
        SoloFSDP(precision="16-mixed")
    with pytest.raises(ValueError, match="state_dict must be"):
        SoloFSDP(state_dict="local")


def test_auto_precision_is_bf16_on_a_gpu_with_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    assert decide_fsdp_precision("auto", torch.device("cuda", 0))[1].value == "bf16-mixed"


def test_batchnorm_keeps_fp32_parameters_under_bf16_and_nested_groups_hand_on_bf16():
    policy, _ = decide_fsdp_precision("bf16-mixed", torch.device("cpu"))
    bn_policy, decision = decide_bn_precision(policy, layers=3)
    assert decision.value == "32-true" and bn_policy.param_dtype == torch.float32
    assert bn_policy.reduce_dtype == torch.float32
    assert not bn_policy.cast_forward_inputs  # the activations come in bf16, as under autocast
    assert decide_bn_precision(policy, layers=0)[0] is None
    assert decide_bn_precision(None, layers=3)[0] is None  # fp32: nothing to keep apart
    assert decide_bn_precision(None, layers=3)[1].value == "as the model"
    # Only a top-level group casts its output to fp32 (the LightningModule's code takes it); a nested one's
    # output stays bf16 for the bf16 layers of the group around it.
    assert group_policy_for(policy, top_level=True).output_dtype == torch.float32
    assert group_policy_for(policy, top_level=False).output_dtype is None
    assert group_policy_for(policy, top_level=False).param_dtype == torch.bfloat16
    assert group_policy_for(None, top_level=False) is None


def test_auto_precision_does_not_count_emulated_bf16(monkeypatch):
    """A GPU that only emulates bf16 (``is_bf16_supported()`` is True by default through emulation, e.g. a V100 or
    T4) gets fp32, as SoloDDP's precision "auto" decides: ``including_emulation=False``."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    assert decide_fsdp_precision("auto", torch.device("cuda", 0))[1].value == "32-true"


@pytest.mark.parametrize(
    ("average", "layers", "world_size", "value"),
    [
        (True, 3, 2, "mean over ranks"),
        (False, 3, 2, "per rank"),  # the switch: stock
        (True, 0, 2, "per rank"),  # nothing to average
        (True, 3, 1, "per rank"),  # one rank
    ],
)
def test_bn_stats_are_averaged_where_there_are_ranks_and_layers(average, layers, world_size, value):
    decision = decide_bn_stats(average, layers, world_size)
    assert decision.setting == "bn_stats" and decision.value == value and decision.reason


def test_sharded_checkpoint_verifies_and_ranks(tmp_path):
    state = {"state_dict": {"w": torch.arange(6.0)}, "optimizer_0": {"step": torch.tensor(3.0)}}
    path = tmp_path / "ckpt" / "step3.ckpt"
    path.parent.mkdir()
    save_sharded(state, {"global_step": 3, "epoch": 0}, path, rank=0, barrier=lambda: None)
    assert verify_sharded(path)["global_step"] == 3
    save_sharded(state, {"global_step": 5, "epoch": 0}, path, rank=0, barrier=lambda: None)  # replaced whole
    assert verify_sharded(path)["global_step"] == 5 and sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert decide_resume(path.parent).value == str(path)
    out = tmp_path / "full.ckpt"
    assert consolidate(path, out)["global_step"] == 5
    assert torch.equal(torch.load(out, weights_only=True)["state_dict"]["w"], torch.arange(6.0))
    next(path.glob("*.distcp")).write_bytes(b"")  # a shard lost its data
    with pytest.raises(CheckpointVerificationError, match="shorter than"):
        verify_sharded(path)
    assert decide_resume(path.parent).value is None
    assert consolidate_main([str(path), str(tmp_path / "x.ckpt")]) == 2


def test_fsdp_option_composes(tmp_path):
    with composed(["parallelism=fsdp", "parallelism.accelerator=cpu"], tmp_path) as cfg:
        check_config(cfg)
        strategy = SoloFSDP(**{k: v for k, v in cfg.parallelism.strategy.items() if k != "_target_"})
    assert strategy.state_dict_type == "sharded" and strategy.min_num_params == 1_000_000


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_fsdp_trains_on_two_cpu_processes_resumes_and_consolidates(tmp_path):
    script = REPO / "tests" / "scripts" / "fsdp_fit.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")], cwd=tmp_path, env=SCRIPT_ENV,
        capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    decisions = result["decisions"]
    assert decisions["fsdp_wrap"] == 2 and decisions["fsdp_state_dict"] == "sharded"
    assert decisions["fsdp_precision"] == "32-true" and result["sharded_param"] == "DTensor"
    assert decisions["lr_global_batch"] == 16 and result["first_lr"] == pytest.approx(0.4 * 16 / 32)
    assert (result["first_fit_steps"], result["resumed_from"], result["global_step"]) == (3, 3, 5)
    # BatchNorm: each rank's own statistics when asked (the first fit), the ranks' mean by default (the second).
    assert result["first_fit_bn_strategy"] == "per rank" and decisions["bn_stats"] == "mean over ranks"
    rank0, rank1 = result["first_fit_bn_mean"]
    assert max(abs(a - b) for a, b in zip(rank0, rank1)) > 1e-3
    assert result["bn_mean"][0] == result["bn_mean"][1]
    assert result["checkpoints"] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert result["consolidated_step"] == 5 and result["consolidated_equals_trained"] is True
    # The BatchNorm model (its first Linear a nested shard group), 4 steps from one seed: SoloFSDP fp32 moves the
    # parameters as SoloDDP does; bf16 FSDP (fp32 BatchNorm) trains, moves them within bf16's rounding, and not
    # exactly (bf16 did run); every rank ends with the same parameters.
    runs = {name: (torch.tensor([x for v in moved.values() for x in v]), d, same)
            for name, (moved, d, same) in result["precisions"].items()}  # fmt: skip
    ddp, fsdp32, bf16 = runs["ddp"][0], runs["fsdp32"][0], runs["fsdp_bf16"][0]
    assert runs["fsdp32"][1]["fsdp_precision"] == "32-true" and runs["ddp"][1]["precision"] == "32-true"
    assert runs["fsdp_bf16"][1] == {"fsdp_precision": "bf16-mixed", "fsdp_bn_precision": "32-true"}
    assert all(same for *_, same in runs.values())
    assert ddp.norm() > 0.1 and torch.allclose(fsdp32, ddp, rtol=1e-5, atol=1e-7)
    assert 1e-4 < ((bf16 - ddp).norm() / ddp.norm()).item() < 3e-2


def _full(path) -> dict:
    """A sharded checkpoint's tensors, gathered into one dict (torch's dcp_to_torch_save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, f"{path}.pt")
    return torch.load(f"{path}.pt", weights_only=True)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_async_sharded_checkpoints_equal_sync_ones_commit_whole_and_resume_exactly(tmp_path):
    script = REPO / "tests" / "scripts" / "fsdp_async_fit.py"
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(script), str(out)], cwd=tmp_path, env=SCRIPT_ENV, capture_output=True,
                          text=True, timeout=230)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    sync, run, resumed = result["sync"], result["async"], result["resume"]
    assert (sync["async_save"], run["async_save"]) == (False, True)
    # The fit's end waited for the last write: both epochs' directories and `last` committed, nothing temporary.
    assert run["listing"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert run["waits"]["saves"] == 2 and run["waits"]["wait_s_max"] > 0.3  # the DCP writes were 0.6 s late
    # A step after the first save, its write in flight: `last` not yet there, a resume takes only what committed.
    (seen,) = run["in_flight"]
    assert "last.ckpt" not in seen["listing"] and any(".solo-tmp-" in n for n in seen["listing"]), seen
    assert seen["chosen"] is None or (".solo-tmp-" not in seen["chosen"] and seen["chosen"].endswith(".ckpt"))
    # Each async checkpoint holds exactly its step (training went on during the write): as the sync run's.
    for name in ("epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"):
        assert verify_sharded(out / "async" / name)["global_step"] == verify_sharded(out / "sync" / name)["global_step"]
        expected, got = _full(out / "sync" / name), _full(out / "async" / name)
        assert expected.keys() == got.keys() == {"state_dict", "optimizer_0"}
        for key, value in expected["state_dict"].items():
            assert torch.equal(got["state_dict"][key], value), (name, key)
        assert str(got["optimizer_0"]) == str(expected["optimizer_0"]), name
    step4, step8 = _full(out / "async" / "epoch=0-step=4.ckpt"), _full(out / "async" / "epoch=1-step=8.ckpt")
    assert any(not torch.equal(step4["state_dict"][k], v) for k, v in step8["state_dict"].items())
    # Resumed from the async `last` (step 8) with ckpt_path="auto": it ends where the uninterrupted run ends.
    assert (resumed["start_step"], resumed["global_step"]) == (8, 12)
    assert resumed["weights"] == sync["weights"]


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "State:\tZ" in status.read()  # a zombie has exited; its reaper may be a container's init
    except FileNotFoundError:
        return True


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_an_exception_on_one_rank_during_an_async_sharded_write_keeps_the_newest_committed(tmp_path):
    # 2 ranks, a save every 2 steps (and `last`), each DCP write 1.5 s late; rank 1 raises at step 5.
    script = REPO / "tests" / "scripts" / "fsdp_async_fault_fit.py"
    out, start = tmp_path / "out", time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(out)], cwd=tmp_path, env=SCRIPT_ENV, capture_output=True,
                          text=True, timeout=110)  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and "ValueError: boom on rank 1" in proc.stderr, proc.stderr[-4000:]
    assert elapsed < 75 and all(_exited(int((out / f"pid-{r}").read_text())) for r in (0, 1))
    raised = json.loads((out / "raised.json").read_text())
    assert any(".solo-tmp-" in name for name in raised), raised  # a write was in flight when rank 1 raised
    # Every directory under a final name verifies whole (the write in flight committed whole or not at all).
    ckpt = out / "ckpt"
    final = [p for p in ckpt.iterdir() if ".solo-tmp-" not in p.name]
    steps = {p.name: verify_sharded(p)["global_step"] for p in final}
    chosen = decide_resume(ckpt).value
    print(f"\nfsdp async exception: {elapsed:.1f} s, at the raise {raised}, after {sorted(steps.items())}")
    assert chosen is not None and ".solo-tmp-" not in chosen and resolve_ckpt_path("auto", ckpt) == chosen
    assert steps[os.path.basename(chosen)] == max(steps.values()) in (2, 4)
    loaded = _full(chosen)  # the newest committed loads: every tensor of the model and of its optimizer
    assert loaded.keys() == {"state_dict", "optimizer_0"}
    assert sorted(loaded["state_dict"]) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]


@pytest.mark.cli
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_commands_on_cpu_work_on_the_default_config(tmp_path):
    # As a new user on a CPU machine: parallelism=fsdp stops with a clear error that suggests a dry run, and
    # that suggestion runs; then FSDP over 2 gloo processes trains the default job (small_cnn on digits).
    proc = run_cli(["parallelism=fsdp"], cwd=tmp_path, timeout=100, full_error=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    suggested = re.search(r"To try this configuration on CPU: python -m lightning_solo.run (.*?) \(", proc.stderr)
    assert suggested, proc.stderr[-4000:]
    args = shlex.split(suggested[1])
    assert args == ["parallelism=fsdp", "+dryrun=cpu"]
    proc = run_cli([*args, "hydra.run.dir=dry", "trainer.enable_progress_bar=false"], cwd=tmp_path, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "dry" / "summary.json").read_text())
    assert (summary["strategy"], summary["world_size"], summary["global_step"]) == ("SoloFSDP", 1, 3)

    args = [
        "parallelism=fsdp",
        "parallelism.accelerator=cpu",
        "parallelism.devices=2",
        "trainer.max_epochs=1",
    ]
    # Without OMP_NUM_THREADS, as from a fresh shell: SoloFSDP's launcher in every rank, not the test, gives every
    # rank the same thread split, or the preflight stops the run (it compares the ranks' environments).
    proc = run_cli([*args, "hydra.run.dir=run", "trainer.enable_progress_bar=false"], cwd=tmp_path, timeout=150,
                   unset=("OMP_NUM_THREADS",))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["strategy"] == "SoloFSDP" and summary["world_size"] == 2 and summary["global_batch"] == 64
    assert summary["global_step"] == 23  # 1,437 digits / 64 per step, rounded up
    decisions = {d["setting"]: d["value"] for d in summary["decisions"]}
    assert decisions["fsdp_state_dict"] == "sharded" and decisions["lr_scale"] == pytest.approx(64 / 256)
    assert decisions["preflight"] == "passed" and decisions["bn_stats"] == "mean over ranks"
    # The sharded checkpoint consolidates into the plain small_cnn, which scores what the run reported.
    consolidate(summary["checkpoint_last"], tmp_path / "model.ckpt")
    state = torch.load(tmp_path / "model.ckpt", weights_only=True)["state_dict"]
    net = SmallCNN(num_classes=10, in_channels=1)
    net.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    data = DigitsDataModule()
    data.setup("fit")
    x, y = data.val_set.tensors
    with torch.no_grad():
        accuracy = (net.eval()(x).argmax(1) == y).float().mean().item()
    assert accuracy == pytest.approx(summary["val_acc"], abs=1.5 / len(y))
    # bf16, as precision "auto" picks on a GPU: the BatchNorm of small_cnn keeps fp32 parameters, and it trains.
    proc = run_cli([*args, "parallelism.precision=bf16-mixed", "trainer.max_steps=3", "hydra.run.dir=bf16",
                    "trainer.enable_progress_bar=false"], cwd=tmp_path, timeout=150)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "bf16" / "summary.json").read_text())
    decisions = {d["setting"]: d["value"] for d in summary["decisions"]}
    assert (decisions["fsdp_precision"], decisions["fsdp_bn_precision"]) == ("bf16-mixed", "32-true")
    assert summary["global_step"] == 3
