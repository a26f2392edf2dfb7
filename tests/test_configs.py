"""Every config composes, builds, and bad input fails before any worker starts, naming the key."""

from __future__ import annotations

import inspect

import hydra
import pytest
import torch
from hydra.errors import ConfigCompositionException, HydraException
from lightning.pytorch.callbacks import TQDMProgressBar
from omegaconf.errors import ConfigKeyError

from lightning_solo.app.config_check import ConfigError, check_config
from lightning_solo.app.preflight import check_devices, check_world_size_env
from lightning_solo.app.progress_bar import RunProgressBar
from lightning_solo.app.run import BAD_INPUT_EXIT, check_run_config, progress_bar, report_bad_input
from lightning_solo.core.cluster import PreflightError
from tests.helpers import CONF, composed


def strategy_default(name: str):
    from lightning_solo import SoloDDP

    return inspect.signature(SoloDDP).parameters[name].default


EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def test_there_are_experiments():
    assert "resnet_4gpu" in EXPERIMENTS


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_builds(experiment, tmp_path):
    with composed([f"+experiment={experiment}", "+dryrun=cpu"], tmp_path) as cfg:
        check_config(cfg)
        dm = hydra.utils.instantiate(cfg.data)
        model = hydra.utils.instantiate(cfg.model)
        strategy = hydra.utils.instantiate(cfg.parallelism.strategy)
        assert dm.num_classes == model.hparams.num_classes
        assert type(strategy).__name__ == "SoloDDP"


def test_default_is_small_cnn_on_digits_and_synthetic_stays_an_option(tmp_path):
    with composed([], tmp_path) as cfg:
        assert cfg.data._target_.endswith("DigitsDataModule") and cfg.model.arch == "small_cnn"
        assert cfg.model.in_channels == 1 and cfg.trainer.max_epochs == 10
    for experiment in ("synthetic_cpu", "quick_cpu"):
        with composed([f"+experiment={experiment}"], tmp_path) as cfg:
            assert cfg.data._target_.endswith("SyntheticDataModule") and cfg.model.arch == "resnet18"


def test_resnet_4gpu_is_what_it_says(tmp_path):
    with composed(["+experiment=resnet_4gpu"], tmp_path) as cfg:
        assert cfg.model.arch == "resnet50"
        assert cfg.parallelism.devices == 4 and cfg.parallelism.accelerator == "gpu"
        assert cfg.parallelism.precision == "auto"
        assert cfg.data._target_.endswith("CIFAR10DataModule")
        # 128 images per GPU need no SyncBN: SoloDDP's "auto" decides (the YAML restates no default of SoloDDP's).
        assert "sync_batchnorm" not in cfg.parallelism.strategy
        assert strategy_default("sync_batchnorm") == "auto"
        assert cfg.trainer.benchmark is True  # fixed shapes: cuDNN's autotuning pays once
        (bar,) = progress_bar(cfg, [])
        assert bar.refresh_rate >= 20 and bar.refresh_rate == cfg.trainer.log_every_n_steps


def test_the_progress_bar_refreshes_where_the_loggers_write(tmp_path):
    # Each refresh reads the bar's metrics from the device (a host sync on GPUs).
    with composed([], tmp_path) as cfg:
        (bar,) = progress_bar(cfg, [])
        assert bar.refresh_rate == cfg.trainer.log_every_n_steps == 10
    with composed(["progress_bar_refresh_rate=1"], tmp_path) as cfg:
        assert progress_bar(cfg, [])[0].refresh_rate == 1
    with composed(["trainer.enable_progress_bar=false"], tmp_path) as cfg:
        assert progress_bar(cfg, []) == []
    with composed([], tmp_path) as cfg:
        assert progress_bar(cfg, [TQDMProgressBar(refresh_rate=3)]) == []  # the user's own bar stays the only one


def test_the_progress_bar_shows_the_training_loss():
    import lightning as L

    bar = RunProgressBar()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[bar], enable_checkpointing=False)
    assert "train/loss" not in bar.get_metrics(trainer, None)
    trainer.callback_metrics["train/loss"] = torch.tensor(0.123456)  # logged without prog_bar=True
    assert bar.get_metrics(trainer, None)["train/loss"] == "0.123"


@pytest.mark.parametrize("group", ["model", "data", "parallelism", "callbacks", "logger", "profile"])
def test_every_group_option_composes(group, tmp_path):
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        overrides = [f"{group}={option}"]
        if option == "image_folder":
            overrides += ["data.root=/nonexistent", "data.num_classes=3"]
        with composed(overrides, tmp_path) as cfg:
            check_config(cfg)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("trainer.max_epochs=abc", "trainer.max_epochs"),
        ("+trainer.max_epoch=3", "trainer.max_epoch"),
        ("data.batch_size=1.5", "data.batch_size"),
        ("data.num_workers=some", "data.num_workers"),  # a loader option the datamodule forwards to its base
        ("+data.num_worker=2", "has no option 'num_worker'. Did you mean 'num_workers'"),
        ("+model.optimizer.momentm=0.1", "model.optimizer.momentm"),
        ("model.stem=foo", "model.stem"),
        ("parallelism.precision=17", "parallelism.precision"),
        ("+parallelism.devics=3", "parallelism.devics"),
        (
            "++parallelism.strategy.timeout=soon",
            "parallelism.strategy.timeout",
        ),  # ++: an option the YAML leaves to SoloDDP
        ("+callbacks.loss_watch.windw=10", "callbacks.loss_watch.windw"),
        ("callbacks.preflight.strict=maybe", "callbacks.preflight.strict"),
        ("callbacks.resource_monitor.every_n_steps=often", "callbacks.resource_monitor.every_n_steps"),
    ],
)
def test_bad_values_name_the_key(override, named, tmp_path):
    with composed([override], tmp_path) as cfg, pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        check_config(cfg)


def test_bad_input_is_one_line_and_exit_2_or_with_hydra_full_error_the_exception(tmp_path, monkeypatch, capsys):
    with composed(["trainer.max_epochs=abc"], tmp_path) as cfg, pytest.raises(ConfigError) as raised:
        check_run_config(cfg)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exited:
        report_bad_input(raised.value)
    assert exited.value.code == BAD_INPUT_EXIT == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning_solo: error: trainer.max_epochs: expected int")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError, match=r"trainer\.max_epochs: expected int"):
        report_bad_input(raised.value)


def test_misspelled_key_and_unknown_option_fail_at_composition(tmp_path):
    with (
        pytest.raises((ConfigCompositionException, ConfigKeyError, HydraException), match="max_epoch"),
        composed(["trainer.max_epoch=3"], tmp_path),
    ):
        pass
    with (
        pytest.raises(ConfigCompositionException, match="resnet999"),
        composed(["model=resnet999"], tmp_path),
    ):
        pass


def test_device_preflight():
    with pytest.raises(PreflightError, match="asks for 4 GPU"):
        check_devices("gpu", 4, 1, dry_run_hint="+dryrun=cpu")
    with pytest.raises(PreflightError, match="num_nodes"):
        check_devices("cpu", 2, 0)
    check_devices("cpu", 4, 1)  # more gloo processes than cores is allowed (the dry run uses it)


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="this machine has the 4 GPUs the experiment asks for")
def test_gpu_experiment_without_gpus_stops_before_any_worker_with_the_dry_run_hint(tmp_path):
    # What `python -m lightning_solo.run +experiment=resnet_4gpu` checks before starting anything; the CLI prints
    # such an error as one line with exit status 2 (test_fsdp.py's parallelism=fsdp command, test_cli.py).
    with composed(["+experiment=resnet_4gpu"], tmp_path) as cfg, pytest.raises(PreflightError) as err:
        check_run_config(cfg)
    message = str(err.value)
    assert "parallelism.devices=4" in message and "asks for 4 GPU(s)" in message
    assert "python -m lightning_solo.run +experiment=resnet_4gpu +dryrun=cpu" in message


def test_world_size_env_must_match(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(PreflightError, match="WORLD_SIZE=3"):
        check_world_size_env(2, 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_world_size_env(2, 2)
