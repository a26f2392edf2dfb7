"""The runner: ``python -m lightning_solo.run [group=option ...] [+experiment=NAME]``. ``train(cfg)`` is a plain
function; ``main`` the Hydra command around it, which imports torch and Lightning once Hydra composed the config."""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_solo.app.config_check import ConfigError, check_config
from lightning_solo.core import cluster
from lightning_solo.core.cluster import PreflightError
from lightning_solo.core.decision import Decision, DecisionLog

log = logging.getLogger(__name__)


def config_path() -> str:
    """Where the configs are (the same for relaunched ranks): ``$LIGHTNING_SOLO_CONFIG_DIR``, else the checkout's
    ``conf/``, else the copy inside the wheel."""
    if env := os.environ.get("LIGHTNING_SOLO_CONFIG_DIR"):
        return str(Path(env).expanduser().resolve())
    checkout = Path(__file__).resolve().parents[2] / "conf"
    if (checkout / "config.yaml").is_file():
        return str(checkout)
    return "pkg://lightning_solo.conf"


def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Build every named entry with a ``_target_`` (``callbacks:``/``logger:`` dicts)."""
    nodes = (group or {}).values()
    return [hydra.utils.instantiate(node) for node in nodes if isinstance(node, DictConfig) and "_target_" in node]


_STRATEGY_OPTION = re.compile(r"parallelism\.strategy\.[A-Za-z_][\w.]*=")


def strategy_options(args: list[str]) -> list[str]:
    """The command line with ``parallelism.strategy.OPTION=VALUE`` made ``++...``: set whether or not the YAML
    lists the option (a misspelled one is still named by :func:`check_config`)."""
    return [f"++{arg}" if _STRATEGY_OPTION.match(arg) else arg for arg in args]


def check_run_config(cfg: DictConfig) -> None:
    """The config's keys and types, the devices it asks for and ``WORLD_SIZE``; then the seed. Raises
    :class:`ConfigError` / :class:`PreflightError` before any worker starts."""
    import lightning as L

    from lightning_solo.app.preflight import check_devices, check_world_size_env

    check_config(cfg)
    par = cfg.parallelism
    hint = " ".join(["python -m lightning_solo.run", *task_overrides(), "+dryrun=cpu"])
    check_devices(par.accelerator, par.devices, par.num_nodes, dry_run_hint=hint)
    check_world_size_env(par.devices, par.num_nodes)
    cluster.check_cluster_environment(par.strategy.get("cluster_environment"))
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True, verbose=False)


def make_trainer(cfg: DictConfig, callbacks: list[Any]) -> Any:
    """The Trainer of ``cfg.trainer`` on ``cfg.parallelism`` (SoloDDP), with ``callbacks`` and the configured loggers."""
    from lightning_solo.app.preflight import refuse_multirun_relaunch

    par = cfg.parallelism
    # A strategy that takes the precision (SoloDDP) alone decides it: "auto" and fp16 on CPU reach it unchanged.
    trainer_precision = None if "precision" in par.strategy else par.precision
    trainer = hydra.utils.instantiate(
        cfg.trainer,
        accelerator=par.accelerator,
        devices=par.devices,
        num_nodes=par.num_nodes,
        precision=trainer_precision,
        strategy=hydra.utils.instantiate(par.strategy),
        callbacks=[*callbacks, *progress_bar(cfg, callbacks)],
        logger=instantiate_group(cfg.get("logger")) or False,
    )
    refuse_multirun_relaunch(trainer)
    return trainer


def progress_bar(cfg: DictConfig, callbacks: list[Any]) -> list[Any]:
    """The bar (with ``train/loss``) at ``progress_bar_refresh_rate``; none when the bar is off or a callback is one."""
    from lightning.pytorch.callbacks import ProgressBar

    from lightning_solo.app.progress_bar import RunProgressBar

    rate = cfg.get("progress_bar_refresh_rate")
    off = rate is None or not cfg.trainer.get("enable_progress_bar", True)
    if off or any(isinstance(cb, ProgressBar) for cb in callbacks):
        return []
    return [RunProgressBar(refresh_rate=rate)]


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train as configured; returns the final metrics (``val/acc``, ...) and, on rank 0, ``summary``."""
    from lightning_solo.app.run_summary import RunSummary
    from lightning_solo.callbacks.config_fingerprint import ConfigFingerprint
    from lightning_solo.checkpoint import checkpoint_dir, hpc_checkpoints, resolve_ckpt_path
    from lightning_solo.ddp.strategy import SoloDDP

    check_run_config(cfg)
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    summary = RunSummary()
    resolved = OmegaConf.to_yaml({k: cfg[k] for k in cfg if k != "hydra"}, resolve=True)
    callbacks = [*instantiate_group(cfg.get("callbacks")), ConfigFingerprint(resolved), summary]
    if cfg.get("auto_batch_size") is not None:  # before WarmupScaledLR and SyncBN read the batch size
        callbacks.insert(0, hydra.utils.instantiate(cfg.auto_batch_size))
    trainer = make_trainer(cfg, callbacks)
    resume = cfg.get("resume")
    # torchrun restarted the workers, or SLURM requeued the job: continue from the newest verified checkpoint.
    if (restart := cluster.decide_restart_resume(resume)) is not None:
        resume = restart.value
        log.info("%s", restart)
    if isinstance(trainer.strategy, DecisionLog):
        for decision in (restart, _run_dir_decision):
            if decision is not None:
                trainer.strategy.decisions[decision.setting] = decision
    # resume=auto under SoloDDP: rank 0 chooses once the process group exists, so the ranks cannot differ.
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


def close_process_group() -> None:
    """Destroy the process group while every rank is alive: a gloo group left to the interpreter's exit can abort
    the process after a good run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def task_overrides() -> list[str]:
    """The command line's overrides, as Hydra composed them (none outside a Hydra app)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


#: Exit status for bad input (a config key or value, or a machine that cannot run the config), as argparse uses.
BAD_INPUT_EXIT = 2


def report_bad_input(err: Exception) -> None:
    """Print ``err`` on one line on stderr and exit with :data:`BAD_INPUT_EXIT` (``HYDRA_FULL_ERROR=1``: raise it)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    message = " ".join(str(err).split())  # the key, what was expected, the hint: on one line
    print(f"lightning_solo: error: {message} (HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
    sys.exit(BAD_INPUT_EXIT)


def hydra_command(config_name: str, task: Callable[[DictConfig], float | None]) -> Callable[[], Any]:
    """The Hydra app of ``config_name`` running ``task(cfg)`` (bad input: :func:`report_bad_input`) on ``sys.argv``
    with the strategy options as ``++``."""

    def app(cfg: DictConfig) -> float | None:
        freeze_imported_objects()
        try:
            return task(cfg)
        except (ConfigError, PreflightError) as err:
            report_bad_input(err)
            return None

    app.__module__ = task.__module__  # Hydra names the job (its log file) after it: "run", "evaluate"
    hydra_app = hydra.main(version_base="1.3", config_path=config_path(), config_name=config_name)(app)

    def command() -> Any:
        sys.argv[1:] = strategy_options(sys.argv[1:])
        return hydra_app()

    return command


def freeze_imported_objects() -> None:
    """Import torch, Lightning and SoloDDP with the cyclic collector paused, then ``gc.freeze()`` every object alive:
    1.4 s less CPU per rank (docs/runner.md). Process-wide, so only the commands' processes (and the tests) do it."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        import lightning_solo.ddp.strategy  # noqa: F401

        gc.freeze()
    finally:
        if collecting:
            gc.enable()


def _train_metric(cfg: DictConfig) -> float | None:
    value = train(cfg).get("val/acc")
    return float(value) if value is not None else None


#: How this process's run directory was agreed with the other ranks (torchrun, SLURM); None otherwise.
_run_dir_decision: Decision | None = None


def main() -> float | None:
    """``python -m lightning_solo.run``: under torchrun or SLURM, first agree on one run directory for all ranks."""
    global _run_dir_decision
    try:
        sys.argv[1:], _run_dir_decision = cluster.decide_run_dir(sys.argv[1:])
    except PreflightError as err:
        report_bad_input(err)
    if (warning := cluster.restart_store_warning()) and cluster.global_rank() == 0:
        warnings.warn(warning, stacklevel=1)
    return hydra_command("config", _train_metric)()


if __name__ == "__main__":
    main()
