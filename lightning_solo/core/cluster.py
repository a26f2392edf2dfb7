"""Runs started by an external launcher (torchrun, SLURM): which one, the run directory every rank of every node
shares, and resuming after the launcher restarted or requeued the job. See docs/multi-node.md."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from datetime import datetime, timedelta

from lightning_solo.core.decision import Decision

#: How long a rank waits for global rank 0 to publish the run directory (rank 0 may still be importing).
AGREE_TIMEOUT = timedelta(minutes=10)
STAMP_FORMAT = "%Y-%m-%d_%H-%M-%S"  # as conf/hydra/default.yaml's run.dir


class PreflightError(RuntimeError):
    """The run cannot start on this machine as configured."""


def launcher(env: Mapping[str, str] = os.environ) -> str | None:
    """``"torchrun"`` (first: under ``srun torchrun`` the ranks are torchrun's), ``"slurm"`` (as Lightning detects
    it) or ``None`` (Lightning starts the processes, or there is only one)."""
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        return "torchrun"
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "slurm"
    return None


def global_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's global rank as its launcher numbers it (0 without one)."""
    kind = launcher(env)
    name = {"torchrun": "RANK", "slurm": "SLURM_PROCID"}.get(kind or "")
    return int(env.get(name, 0)) if name else 0


def slurm_job_id(env: Mapping[str, str] = os.environ) -> str:
    """``<array job>_<task>`` for an array task, else ``SLURM_JOB_ID``: what ``scontrol requeue`` takes."""
    if env.get("SLURM_ARRAY_JOB_ID") is not None:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def decide_run_dir(args: list[str], env: Mapping[str, str] = os.environ) -> tuple[list[str], Decision | None]:
    """The runner's command line with the overrides that give every rank one run directory (a user's
    ``hydra.run.dir=`` kept); unchanged without an external launcher (Lightning's passes rank 0's on itself)."""
    kind = launcher(env)
    if kind is None:
        return list(args), None
    rank = global_rank(env)
    extra: list[str] = []
    if any(arg.startswith("hydra.run.dir=") for arg in args):
        decision = Decision("run_dir", "hydra.run.dir", "given on the command line")
    else:
        if kind == "slurm":
            name = f"slurm-{slurm_job_id(env)}"
            why = "the SLURM job id: the same on every task, and again after a requeue"
        else:
            name, why = _agreed_name(env, rank)
        extra.append(f"hydra.run.dir=${{paths.log_dir}}/${{task_name}}/{name}")
        decision = Decision("run_dir", name, why)
    if rank != 0:
        extra += ["hydra.output_subdir=null", f"hydra.job.name=train_ddp_process_{rank}"]
    return [*args, *extra], decision


def _agreed_name(env: Mapping[str, str], rank: int) -> tuple[str, str]:
    """Rank 0's timestamp through torchrun's agent store (kept across restarts); without it, the rendezvous id."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        if run_id != "none":
            return f"torchrun-{run_id}", "torchrun's rendezvous id (--rdzv-id): the same on every node and restart"
        raise PreflightError(
            "under this torchrun rendezvous the ranks cannot agree on a run directory before training starts: "
            "pass hydra.run.dir=<a directory all nodes share>, or torchrun --rdzv-id=<job id>"
        )
    from torch.distributed import TCPStore

    store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=AGREE_TIMEOUT)
    key = f"lightning_solo/run_dir/{run_id}"
    if rank == 0:  # sets it unless an earlier attempt did; returns the stored value either way
        name = store.compare_set(key, "", datetime.now().strftime(STAMP_FORMAT)).decode()
    else:
        name = store.get(key).decode()
    return name, "global rank 0's start time, shared through torchrun's store (the same after a restart)"


def decide_restart_resume(resume: str | None, env: Mapping[str, str] = os.environ) -> Decision | None:
    """``resume=auto`` for a job its launcher may restart (torchrun: every start when restarts are allowed; SLURM:
    a requeued job), unless the user asked for something else; else ``None``. See docs/multi-node.md."""
    kind = launcher(env)
    if resume is not None or kind is None:
        return None
    if kind == "slurm":
        count = int(env.get("SLURM_RESTART_COUNT", 0) or 0)
        if count <= 0:
            return None
        return Decision("resume_after_restart", "auto", f"SLURM requeued the job (SLURM_RESTART_COUNT={count})")
    count = int(env.get("TORCHELASTIC_RESTART_COUNT", 0) or 0)
    allowed = int(env.get("TORCHELASTIC_MAX_RESTARTS", 0) or 0)
    if count <= 0 and allowed <= 0:
        return None
    state = f"restart {count} of at most {allowed}" if count > 0 else f"up to {allowed} restart(s) allowed"
    return Decision(
        "resume_after_restart",
        "auto",
        f"torchrun ({state}): continue from the newest verified checkpoint in the run directory, if any",
    )


def restart_store_warning(env: Mapping[str, str] = os.environ) -> str | None:
    """The warning for torchrun restarting workers that share its rendezvous store (a restarted group can fail to
    connect, docs/multi-node.md); ``None`` when nothing is wrong."""
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", 0) or 0)
    if launcher(env) != "torchrun" or restarts <= 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (
        "torchrun may restart the workers (--max-restarts > 0) but shares its rendezvous store with them: a "
        "restarted group can pick up the previous attempt's addresses and fail to connect (pytorch#135712). "
        "Launch with --rdzv-backend c10d --rdzv-id <job id> and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."
    )


def decide_external_launch(environment: object) -> Decision | None:
    """The start method, when the cluster environment's launcher (torchrun, SLURM) started every process and
    Lightning started none; ``None`` otherwise (the strategy's own launcher decision stands)."""
    if not getattr(environment, "creates_processes_externally", False):
        return None
    name = type(environment).__name__
    return Decision("start_method", "external", f"{name}: the launcher started every process, on every node")


_EXPECTED = {
    "TorchElasticEnvironment": ("torchrun", "start it with torchrun (docs/multi-node.md)"),
    "SLURMEnvironment": ("slurm", "submit it with sbatch/srun or hydra/launcher=submitit_slurm (docs/multi-node.md)"),
}


def check_cluster_environment(cluster_environment: Mapping | None, env: Mapping[str, str] = os.environ) -> None:
    """Raise :class:`PreflightError` when the config names torchrun's or SLURM's environment and that launcher did
    not start this process."""
    target = str((cluster_environment or {}).get("_target_", ""))
    name = target.rsplit(".", 1)[-1]
    if name not in _EXPECTED:
        return
    expected, hint = _EXPECTED[name]
    found = launcher(env)
    if found != expected:
        started = f"was started by {found}" if found else "was not started by a cluster launcher"
        raise PreflightError(f"parallelism.strategy.cluster_environment is {name}, but this process {started}: {hint}")


def gloo_interface_warning(
    hostname: str | None = None, ifname: str | None = None, resolve=socket.gethostbyname
) -> str | None:
    """What is wrong with gloo's network interface on this node of a multi-node job (the hostname resolves to
    loopback, or not at all, and no ``GLOO_SOCKET_IFNAME``), with the fix; ``None`` when nothing is."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") if ifname is None else ifname
    if ifname:
        return None
    hostname = hostname or socket.gethostname()
    nccl = os.environ.get("NCCL_SOCKET_IFNAME")
    fix = (
        f"Set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on "
        f"({'e.g. GLOO_SOCKET_IFNAME=' + nccl + ', as NCCL uses' if nccl else 'see `ip -br addr`'}), "
        "or pass SoloDDP(gloo_side_group=False) to do without gloo on an NCCL job."
    )
    try:
        address = resolve(hostname)
    except OSError as err:
        return f"gloo picks its interface from the hostname {hostname!r}, which does not resolve ({err}). {fix}"
    if ipaddress.ip_address(address).is_loopback:
        return (
            f"gloo picks its interface from the hostname {hostname!r}, which resolves to the loopback address "
            f"{address}: ranks on other nodes cannot connect to it. {fix}"
        )
    return None
