"""The runner: ``python -m lightning_solo.run [group=option ...] [+experiment=NAME]``.

``train(cfg)`` is a plain function (importable, testable); ``main`` is the thin Hydra wrapper. The path
of a run: check the config and the machine → build datamodule, model, strategy, callbacks, loggers and
Trainer from the config → fit → summary. Lightning's popen launcher re-runs this command for ranks
1..N-1 with ``hydra.run.dir`` set to rank 0's, so every rank composes the same config and writes into
one run directory; under torchrun or SLURM, where every process starts the command itself, ``main`` agrees
on that directory before Hydra runs (:mod:`lightning_solo.core.cluster`).
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import hydra
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig, OmegaConf

from lightning_solo.app.config_check import ConfigError, check_config
from lightning_solo.app.preflight import (
    PreflightError,
    check_devices,
    check_world_size_env,
    refuse_multirun_relaunch,
)
from lightning_solo.app.progress_bar import RunProgressBar
from lightning_solo.checkpoint import checkpoint_dir, hpc_checkpoints, resolve_ckpt_path
from lightning_solo.core import cluster
from lightning_solo.core.decision import Decision, DecisionLog
from lightning_solo.ddp.strategy import SoloDDP

log = logging.getLogger(__name__)


def config_path() -> str:
    """Where the configs are. Deterministic, so that relaunched ranks find the same ones:
    ``$LIGHTNING_SOLO_CONFIG_DIR``, else the checkout's ``conf/``, else the copy inside the wheel."""
    env = os.environ.get("LIGHTNING_SOLO_CONFIG_DIR")
    if env:
        return str(Path(env).expanduser().resolve())
    checkout = Path(__file__).resolve().parents[2] / "conf"
    if (checkout / "config.yaml").is_file():
        return str(checkout)
    return "pkg://lightning_solo.conf"


def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Build every named entry with a ``_target_`` (``callbacks:``/``logger:`` dicts)."""
    if not group:
        return []
    return [
        hydra.utils.instantiate(node) for node in group.values() if isinstance(node, DictConfig) and "_target_" in node
    ]


_STRATEGY_OPTION = re.compile(r"parallelism\.strategy\.[A-Za-z_][\w.]*=")


def strategy_options(args: list[str]) -> list[str]:
    """The command line with ``parallelism.strategy.OPTION=VALUE`` made ``++parallelism.strategy.OPTION=VALUE``.

    The parallelism YAMLs hold only what the runner sets differently from the strategy's own defaults, which
    live in the strategy's signature alone; Hydra would refuse to override an option the YAML does not list
    (``+`` needed), and to add one it does (``+`` refused). ``++`` sets it either way, and a misspelled option is
    still named by :func:`~lightning_solo.app.config_check.check_config` against the strategy's signature."""
    return [f"++{arg}" if _STRATEGY_OPTION.match(arg) else arg for arg in args]


def check_run_config(cfg: DictConfig) -> None:
    """The config's keys and types, the devices it asks for and ``WORLD_SIZE``; then the seed. Raises
    :class:`ConfigError` / :class:`PreflightError` before any worker starts."""
    import lightning as L

    check_config(cfg)
    par = cfg.parallelism
    check_devices(par.accelerator, par.devices, par.num_nodes, dry_run_hint=_dry_run_hint(cfg))
    check_world_size_env(par.devices, par.num_nodes)
    cluster.check_cluster_environment(par.strategy.get("cluster_environment"))
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True, verbose=False)


def make_trainer(cfg: DictConfig, callbacks: list[Any]) -> Any:
    """The Trainer of ``cfg.trainer`` on ``cfg.parallelism`` (SoloDDP), with ``callbacks`` and the configured loggers."""
    par = cfg.parallelism
    # When the strategy takes the precision (SoloDDP does: parallelism.strategy.precision), it alone
    # decides; the Trainer gets none, so "auto" and real fp16 on CPU reach SoloDDP unchanged.
    trainer_precision = None if "precision" in par.strategy else par.precision
    callbacks = [*callbacks, *progress_bar(cfg, callbacks)]
    trainer = hydra.utils.instantiate(
        cfg.trainer,
        accelerator=par.accelerator,
        devices=par.devices,
        num_nodes=par.num_nodes,
        precision=trainer_precision,
        strategy=hydra.utils.instantiate(par.strategy),
        callbacks=callbacks,
        logger=instantiate_group(cfg.get("logger")) or False,
    )
    refuse_multirun_relaunch(trainer)
    return trainer


def progress_bar(cfg: DictConfig, callbacks: list[Any]) -> list[Any]:
    """The bar (with ``train/loss``) at ``progress_bar_refresh_rate``: each refresh reads its metrics from the
    device. None when the bar is off or a callback is a progress bar already."""
    rate = cfg.get("progress_bar_refresh_rate")
    if rate is None or not cfg.trainer.get("enable_progress_bar", True):
        return []
    if any(isinstance(cb, ProgressBar) for cb in callbacks):
        return []
    return [RunProgressBar(refresh_rate=rate)]


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train as configured; returns the final metrics (``val/acc``, ...) and, on rank 0, ``summary``."""
    from lightning_solo.app.run_summary import RunSummary
    from lightning_solo.callbacks.config_fingerprint import ConfigFingerprint

    check_run_config(cfg)
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    summary = RunSummary()
    callbacks = [*instantiate_group(cfg.get("callbacks")), ConfigFingerprint(_resolved_yaml(cfg)), summary]
    if cfg.get("auto_batch_size") is not None:  # before WarmupScaledLR and SyncBN read the batch size
        callbacks.insert(0, hydra.utils.instantiate(cfg.auto_batch_size))
    trainer = make_trainer(cfg, callbacks)
    # resume=auto: the newest checkpoint in the checkpoint callback's directory that verifies (or a fresh start);
    # SoloDDP chooses it on rank 0 once the process group exists, so the ranks cannot pick different files.
    resume = cfg.get("resume")
    # torchrun restarted the workers, or SLURM requeued the job: continue from the newest verified checkpoint.
    if (restart := cluster.decide_restart_resume(resume)) is not None:
        resume = restart.value
        log.info("%s", restart)
    if isinstance(trainer.strategy, DecisionLog):
        for decision in (restart, _run_dir_decision):
            if decision is not None:
                trainer.strategy.decisions[decision.setting] = decision
    ckpt_path = (
        "auto"
        if resume == "auto" and isinstance(trainer.strategy, SoloDDP)
        else resolve_ckpt_path(resume, checkpoint_dir(trainer), hpc_checkpoints(trainer))
    )
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    close_process_group()
    metrics: dict[str, Any] = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    if summary.summary is not None:
        metrics["summary"] = summary.summary
    return metrics


def _resolved_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml({k: cfg[k] for k in cfg if k != "hydra"}, resolve=True)


def close_process_group() -> None:
    """Destroy the process group while every rank is still alive: a gloo group left to the interpreter's
    exit can abort the process ("terminate called without an active exception") after a good run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _dry_run_hint(cfg: DictConfig) -> str | None:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    overrides = list(HydraConfig.get().overrides.task)
    return "python -m lightning_solo.run " + " ".join([*overrides, "+dryrun=cpu"])


#: Exit status for bad input (a config key or value, or a machine that cannot run the config), as argparse uses.
BAD_INPUT_EXIT = 2


def report_bad_input(err: Exception) -> None:
    """Print ``err`` as one line on stderr and exit with :data:`BAD_INPUT_EXIT`; re-raise it (the full
    traceback) when ``HYDRA_FULL_ERROR=1``."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    message = " ".join(str(err).split())  # the key, what was expected, the hint: on one line
    print(f"lightning_solo: error: {message} (HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
    sys.exit(BAD_INPUT_EXIT)


@hydra.main(version_base="1.3", config_path=config_path(), config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        metrics = train(cfg)
    except (ConfigError, PreflightError) as err:
        report_bad_input(err)
    value = metrics.get("val/acc")
    return float(value) if value is not None else None


#: How this process's run directory was agreed with the other ranks (torchrun, SLURM); None otherwise.
_run_dir_decision: Decision | None = None


def freeze_imported_objects() -> None:
    """Move every object alive now, the imports' (torch, Lightning, Hydra: ~0.4 M), to the cyclic collector's
    permanent generation (``gc.freeze``). None of them is garbage, yet each full collection walks them all
    (~0.4 s here), several times while the interpreter exits: a rank of a run starts and exits with 1.4 s less
    CPU (benchmarks/RESULTS.md), a full collection during training skips them, and a forked loader worker's does not
    write to the pages it shares with its rank. Only the command's own processes do this: it is process-wide, so
    the library leaves a user's process alone."""
    gc.freeze()


def main() -> float | None:
    """``python -m lightning_solo.run``: under torchrun or SLURM, first agree on one run directory for all
    ranks of all nodes (global rank 0 decides), then run the Hydra app."""
    global _run_dir_decision
    freeze_imported_objects()
    sys.argv[1:] = strategy_options(sys.argv[1:])
    try:
        sys.argv[1:], _run_dir_decision = cluster.decide_run_dir(sys.argv[1:])
    except PreflightError as err:
        report_bad_input(err)
    if (warning := cluster.restart_store_warning()) and cluster.global_rank() == 0:
        warnings.warn(warning, stacklevel=1)
    return _hydra_main()


if __name__ == "__main__":
    main()
