"""The launcher's variables (torchrun, SLURM, Lightning's) and the process-group backend, checked (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from lightning_solo.diagnostics.checks.finding import Finding

_COUNTS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_PORT",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NNODES",
)  # fmt: skip
# (the launcher's variable, the generic one it must equal) when both are set
_SLURM_PAIRS = (("SLURM_PROCID", "RANK"), ("SLURM_NTASKS", "WORLD_SIZE"), ("SLURM_LOCALID", "LOCAL_RANK"))


def check_launch_env(
    env: Mapping[str, str], *, placement: Mapping[str, int] | None = None, gpus_visible: int | None = None
) -> list[Finding]:
    """Problems with the distributed variables in ``env``, also against ``placement`` (the process group's
    ``RANK``, ``WORLD_SIZE``, ... -> int) and ``gpus_visible`` (this node's GPUs, on GPU)."""
    found: list[Finding] = []
    values: dict[str, int] = {}

    def bad(name: str, message: str) -> None:
        found.append(Finding(f"env.{name}", message, error=True))

    for name in (n for n in _COUNTS if n in env):
        if env[name].strip().isdigit():
            values[name] = int(env[name])
        else:
            bad(name, f"{name}={env[name]!r} is not a non-negative integer")

    rank, world, local = values.get("RANK"), values.get("WORLD_SIZE"), values.get("LOCAL_RANK")
    local_world = values.get("LOCAL_WORLD_SIZE")
    if world is not None and world < 1:
        bad("WORLD_SIZE", "WORLD_SIZE=0: a job has at least one process")
    if rank is not None and world is not None and rank >= world:
        bad("RANK", f"RANK={rank} is not below WORLD_SIZE={world}; ranks run 0..WORLD_SIZE-1")
    if rank is not None and "WORLD_SIZE" not in env:
        bad("WORLD_SIZE", "RANK is set without WORLD_SIZE; a launcher sets both (torchrun does)")
    if local is not None and local_world is not None and local >= local_world:
        bad("LOCAL_RANK", f"LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={local_world}")
    if local is not None and rank is not None and local > rank:
        bad("LOCAL_RANK", f"LOCAL_RANK={local} exceeds RANK={rank}: a rank's local index cannot exceed its global one")
    if world and local_world and world % local_world:
        bad(
            "LOCAL_WORLD_SIZE",
            f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}: torchrun needs the same "
            "number of processes on every node",
        )
    if world is not None and world > 1 and rank is not None:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name):
                bad(name, f"{name} is not set but WORLD_SIZE={world}: ranks cannot meet without it")
    port = values.get("MASTER_PORT")
    if port is not None and not 0 < port < 65536:
        bad("MASTER_PORT", f"MASTER_PORT={port} is not a TCP port (1..65535)")
    if "TORCHELASTIC_RUN_ID" not in env:  # under torchrun, torchrun's variables rule; SLURM's describe srun
        for slurm, generic in _SLURM_PAIRS:
            if slurm in values and generic in values and values[slurm] != values[generic]:
                bad(
                    generic,
                    f"{generic}={values[generic]} but {slurm}={values[slurm]}: the variables of two launchers "
                    "disagree; launch with one of them (srun alone, or torchrun inside the allocation)",
                )
    for name, actual in (placement or {}).items():
        if name in values and values[name] != actual:
            bad(name, f"{name}={values[name]} in the environment, but this process is {name.lower()} {actual}")
    if gpus_visible is not None and local is not None and local >= max(gpus_visible, 1):
        message = (
            f"LOCAL_RANK={local} but {gpus_visible} GPU(s) are visible on this node: ranks would share or miss GPUs. "
            "Start at most one process per visible GPU, or widen CUDA_VISIBLE_DEVICES."
        )
        found.append(Finding("env.LOCAL_RANK", message))
    return found


def check_backend(backend: str | None, device_type: str) -> Finding | None:
    """An error when ``backend`` cannot carry ``device_type`` tensors, a warning when it is slow for them."""
    if not backend:
        return None
    per_device = dict(p.split(":", 1) for p in backend.split(",") if ":" in p) if ":" in backend else None
    chosen = per_device.get(device_type) if per_device is not None else backend
    if chosen is None:
        return Finding(
            "backend", f"backend {backend!r} names no backend for {device_type} tensors; add '{device_type}:...'", True
        )
    if chosen == "nccl" and device_type != "cuda":
        return Finding(
            "backend",
            f"backend 'nccl' cannot carry {device_type} tensors: use gloo (SoloDDP picks it when "
            "process_group_backend is left unset)",
            error=True,
        )
    if chosen == "gloo" and device_type == "cuda":
        return Finding(
            "backend",
            "backend 'gloo' on GPUs copies every gradient through the host: leave process_group_backend unset "
            "(SoloDDP picks nccl on CUDA)",
        )
    return None
