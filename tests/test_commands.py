"""Every runner command the README shows, and every one an error message suggests, works on top of the default
config: it composes, passes the config check, and its model takes its data (a GPU command as its dry run on CPU,
which is what the runner suggests on a machine without GPUs). The ones that must run end to end (the default
job, its evaluation, FSDP on CPU) are in test_cli.py and test_fsdp.py. The parallelism YAMLs restate none of
the strategies' defaults: those live in the strategies' signatures alone."""

from __future__ import annotations

import inspect
import re
import shlex

import hydra
import pytest
import torch
from omegaconf import OmegaConf

from lightning_solo.app.config_check import check_config
from lightning_solo.app.run import strategy_options
from tests.helpers import CONF, REPO, composed


def readme_run_commands() -> list[list[str]]:
    """The arguments of every ``lightning_solo.run`` command in the README's code blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.DOTALL)
    commands = []
    for line in "\n".join(blocks).splitlines():
        if "lightning_solo.run" not in line:
            continue
        args = line.split("lightning_solo.run", 1)[1].split("#", 1)[0]
        commands.append(shlex.split(args))
    return commands


COMMANDS = readme_run_commands()
# What error messages suggest: the multirun refusal's launcher, the preflight's dry run (added below for GPUs).
SUGGESTED = [["-m", "trainer.max_epochs=1,2", "parallelism.strategy.start_method=spawn"]]


def test_the_readme_shows_the_commands_this_file_checks():
    assert [] in COMMANDS  # the first command: the defaults
    assert ["parallelism=fsdp", "parallelism.devices=8"] in COMMANDS
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize("args", COMMANDS + SUGGESTED, ids=lambda a: " ".join(a) or "(defaults)")
def test_command_composes_and_its_model_takes_its_data(args, tmp_path):
    overrides = [a for a in strategy_options(args) if a != "-m"]
    overrides = [a.split(",")[0] if a.startswith("trainer.max_epochs=") else a for a in overrides]  # one sweep point
    with composed(overrides, tmp_path) as cfg:
        if cfg.parallelism.accelerator == "gpu" and "+dryrun=cpu" not in overrides:
            overrides.append("+dryrun=cpu")  # the runner's hint on a machine without the GPUs
    with composed(overrides, tmp_path) as cfg:
        check_config(cfg)
        assert cfg.parallelism.accelerator == "cpu"
        hydra.utils.instantiate(cfg.parallelism.strategy)
        data = hydra.utils.instantiate(cfg.data)
        model = hydra.utils.instantiate(cfg.model)
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    with torch.no_grad():
        logits = model.eval()(x[:2])
    assert logits.shape == (2, model.hparams.num_classes) and int(y.max()) < model.hparams.num_classes


def _defaults(target: str) -> dict:
    cls = hydra.utils.get_class(target)
    return {
        name: p.default
        for name, p in inspect.signature(cls).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize("path", sorted((CONF / "parallelism").glob("*.yaml")), ids=lambda p: p.name)
def test_parallelism_yaml_holds_overrides_only(path):
    strategy = OmegaConf.to_container(OmegaConf.load(path)).get("strategy") or {}
    if "_target_" not in strategy:
        return  # an overlay on another option (gpu, torchrun, slurm): its keys differ from that option's
    defaults = _defaults(strategy["_target_"])
    for key, value in strategy.items():
        if key.startswith("_") or (isinstance(value, str) and value.startswith("${")):
            continue  # interpolations route the runner's own keys (parallelism.precision) to the strategy
        assert key in defaults, f"{path.name}: strategy.{key} is no option of {strategy['_target_']}"
        default = defaults[key]
        default = default.total_seconds() if hasattr(default, "total_seconds") else default
        assert value != default, f"{path.name}: strategy.{key}={value!r} restates {strategy['_target_']}'s default"
