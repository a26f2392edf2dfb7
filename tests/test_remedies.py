"""Diagnostics name library settings (``DataLoader.num_workers``, ``SoloDDP.comm_hook``); the runner maps them to
its config keys in one place, ``lightning_solo.app.remedies``, and every override it shows composes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from lightning_solo.app.config_check import check_config
from lightning_solo.app.remedies import config_key, config_override, remedy_rows, with_config_keys
from lightning_solo.app.run import strategy_options
from lightning_solo.app.run_summary import format_summary
from lightning_solo.diagnostics.checks.setup_checks import TrainingSetup, check_setup
from lightning_solo.diagnostics.doctor.verdict import RankTimes, Setup, diagnose
from tests.helpers import REPO, composed

DIAGNOSTICS = REPO / "lightning_solo" / "diagnostics"
# Config keys of the runner, as they would appear in library text.
RUNNER_KEY = re.compile(
    r"\b(parallelism\.[a-z_]+|data\.(num_workers|batch_size|pin_memory|prefetch_factor)"
    r"|trainer\.(accumulate_grad_batches|gradient_clip_val|max_epochs)|callbacks\.[a-z_]+\.[a-z_]+"
    r"|auto_batch_size\.[a-z_]+)"
)
# Still to be reworded by their owner (LossWatch's advice): drop each file here once it names library settings.
PENDING: set[str] = set()


def _all_remedies() -> list[tuple[str | None, object]]:
    """Every (setting, value) the verdict offers, over setups that reach each remedy."""
    same = [RankTimes(1, 10, 30, 1)] * 2
    setups = [
        ([RankTimes(40, 8, 1, 1)] * 2, Setup(device="cpu", world_size=2, idle_cores=3)),
        ([RankTimes(40, 8, 1, 1)] * 2, Setup(device="cuda", world_size=2, num_workers=2)),
        (same, Setup(device="cuda", world_size=2, per_device_batch=32)),
        (same, Setup(world_size=2, bucket_count=1, gradient_mib=100.0)),
        (same, Setup(world_size=2, bucket_count=40, gradient_mib=10.0)),
        ([RankTimes(1, 30, 2, 1)] * 2, Setup(device="cuda", world_size=2, precision="32-true")),
        ([RankTimes(41, 10, 2, 1), RankTimes(1, 10, 42, 1)], Setup(world_size=2)),
    ]
    return [(r.setting, r.value) for ranks, setup in setups for r in diagnose(ranks, setup).remedies]


def _verdict_settings() -> set[str]:
    """The first argument of every ``Remedy(...)`` in verdict.py that names a setting."""
    tree = ast.parse((DIAGNOSTICS / "doctor" / "verdict.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Remedy"]
    return {c.args[0].value for c in calls if isinstance(c.args[0], ast.Constant) and c.args[0].value}


def test_every_remedy_names_a_library_setting_the_runner_can_set(tmp_path):
    remedies = _all_remedies()
    named = {setting for setting, _ in remedies if setting}
    assert named == _verdict_settings(), "a remedy the setups above never reach: add a setup"
    overrides = sorted({config_override(setting, value) for setting, value in remedies if setting})
    assert None not in overrides and "data.num_workers=3" in overrides
    assert "parallelism.strategy.comm_hook=post_local_sgd" in overrides and "parallelism.precision=auto" in overrides
    for override in overrides:  # each as a user would type it after reading the summary
        with composed(strategy_options([override]), tmp_path) as cfg:
            check_config(cfg)


def test_setup_findings_name_library_settings_and_the_runner_adds_its_keys():
    gpu = TrainingSetup(device_type="cuda", world_size=8, cores_per_process=6, per_device_batch=4, num_workers=0,
                        pin_memory=False, map_style=True, sharded=True, unsynced_batchnorm=3)  # fmt: skip
    found = {f.check: f.message for f in check_setup(gpu)}
    assert "DataLoader(num_workers=5)" in found["loader.num_workers"]
    for message in found.values():
        assert not RUNNER_KEY.search(message), message
    shown = {check: with_config_keys(message) for check, message in found.items()}
    assert shown["loader.num_workers"].endswith("[runner: data.num_workers=5]")
    assert shown["loader.pin_memory"].endswith("[runner: data.pin_memory=true]")
    assert "parallelism.strategy.sync_batchnorm=auto" in shown["model.batchnorm"]
    assert "data.batch_size=16, trainer.accumulate_grad_batches]" in shown["loader.batch_size"]
    assert with_config_keys("no call here") == "no call here"
    assert (
        with_config_keys("see torch.compile(mode='max') and Foo(x=1)") == "see torch.compile(mode='max') and Foo(x=1)"
    )


def test_config_keys_come_from_one_map():
    assert config_key("SoloDDP.bucket_cap_mb") == "parallelism.strategy.bucket_cap_mb"
    assert config_key("SoloFSDP.state_dict") == "parallelism.strategy.state_dict"
    assert config_key("SoloDDP.precision") == "parallelism.precision"
    assert config_key("WarmupScaledLR.warmup_steps") == "callbacks.warmup_scaled_lr.warmup_steps"
    assert config_key("Trainer.gradient_clip_val") == "trainer.gradient_clip_val"
    assert config_key("Unknown.option") is None and config_key(None) is None
    assert config_override("SoloDDP.bucket_cap_mb", 100.0) == "parallelism.strategy.bucket_cap_mb=100"
    assert config_override("DataLoader.pin_memory", True) == "data.pin_memory=true"


def test_the_run_summary_shows_the_doctors_remedies_as_overrides():
    remedies = [
        {"setting": "DataLoader.num_workers", "value": 3, "action": "load in workers", "gain": 0.5},
        {"setting": None, "value": None, "action": "check rank 1's node", "gain": 0.2},
    ]
    summary = {
        "world_size": 2, "num_nodes": 1, "devices_per_node": 2, "accelerator": "CPUAccelerator",
        "cluster_environment": "LightningEnvironment", "strategy": "SoloDDP", "strategy_settings": {},
        "precision": "32-true", "per_device_batch": 32, "global_batch": 64, "accumulate_grad_batches": 1,
        "lr": {}, "global_step": 1, "epochs": 1, "val_acc": None, "checkpoint_last": None,
        "checkpoint_best": None, "log_dir": None, "decisions": [], "advice": [],
        "doctor": {"json": "doctor.json", "bound": "data", "remedies": remedy_rows(remedies)},
    }  # fmt: skip
    text = format_summary(summary)
    assert "remedy" in text and "data.num_workers=3: load in workers (~50% of the step)" in text
    assert "(no setting): check rank 1's node (~20% of the step)" in text


def _string_constants(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


@pytest.mark.parametrize(
    "path",
    sorted(DIAGNOSTICS.rglob("*.py")),
    ids=lambda p: str(p.relative_to(DIAGNOSTICS)),
)
def test_diagnostics_name_no_runner_config_key(path):
    found = [
        f"{path.name}:{line}: {m.group(0)}" for line, text in _string_constants(path) for m in RUNNER_KEY.finditer(text)
    ]
    if path.name in PENDING and found:
        pytest.xfail(f"its advice still names runner keys: {found}")
    assert found == [], "diagnostics name library settings (DataLoader(num_workers=...)); app/remedies.py maps them"
    assert path.name not in PENDING, "this file names no runner key any more: take it off PENDING"
