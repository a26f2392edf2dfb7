"""The runner's checks before any worker starts: devices that exist, a world size that agrees with the launcher's
environment, no Hydra multirun on a launcher that re-runs the command (``__main__``: the preflight command)."""

from __future__ import annotations

import os

import torch

from lightning_solo.core.checks import check_int, is_int
from lightning_solo.core.cluster import PreflightError


def check_devices(accelerator: str, devices, num_nodes: int, dry_run_hint: str | None = None) -> None:
    """``devices`` may be an int, a list of ids, ``-1`` or ``"auto"`` (Lightning's forms)."""
    check_int("parallelism.num_nodes", num_nodes, error=PreflightError)
    wanted = len(devices) if isinstance(devices, (list, tuple)) else devices
    if accelerator in ("gpu", "cuda"):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need = have if wanted in (-1, "auto", "-1") else int(wanted)
        if have == 0 or need > have:
            hint = f" To try this configuration on CPU: {dry_run_hint}" if dry_run_hint else ""
            raise PreflightError(
                f"parallelism.devices={devices!r} asks for {need or 'all'} GPU(s) per node but this machine has "
                f"{have}.{hint}"
            )
    elif accelerator == "cpu" and is_int(wanted) and wanted < 1:
        raise PreflightError(f"parallelism.devices must be >= 1 processes on CPU, got {devices!r}")


def check_world_size_env(devices, num_nodes: int) -> None:
    """Under torchrun/SLURM the launcher sets WORLD_SIZE; it must equal devices × nodes."""
    env = os.environ.get("WORLD_SIZE")
    if env is None or not isinstance(devices, int) or devices < 1:
        return
    expected = devices * num_nodes
    if int(env) != expected:
        raise PreflightError(
            f"WORLD_SIZE={env} from the environment does not match parallelism.devices × num_nodes = "
            f"{devices} × {num_nodes} = {expected}. Start as many processes as devices × nodes, or fix the config."
        )


def refuse_multirun_relaunch(trainer) -> None:
    """Refuse Hydra multirun on a launcher that re-runs ``sys.argv``: every child would run its own sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from lightning_solo._compat.lightning import SubprocessScriptLauncher

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    strategy = trainer.strategy
    relaunches = isinstance(getattr(strategy, "launcher", None), SubprocessScriptLauncher)
    external = getattr(getattr(strategy, "cluster_environment", None), "creates_processes_externally", False)
    if relaunches and not external and getattr(strategy, "num_processes", 1) > 1:
        raise PreflightError(
            "Hydra multirun (-m) cannot be combined with the 'popen' launcher: each child process would re-run "
            "the whole sweep with its own output folders. Use parallelism.strategy.start_method=spawn (or fork) "
            "for local sweeps, or a cluster launcher that starts one task per rank (hydra/launcher=submitit_slurm)."
        )
