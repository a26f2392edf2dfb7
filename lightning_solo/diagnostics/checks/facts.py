"""What each rank reports about itself for the cross-rank preflight. See docs/diagnostics.md."""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

import lightning
import torch
import torch.distributed as dist

from lightning_solo.diagnostics.checks.finding import Finding

# Variables that change NCCL/gloo behaviour must agree; the logging ones may differ.
_AGREED_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_")
_MAY_DIFFER = {"NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}
# Interface names are per host (eth0 on one node, ens5 on another is fine).
_PER_HOST = {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA"}
_AGREED_VARS = ("OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")


@dataclass(frozen=True)
class RankFacts:
    rank: int
    host: str
    local_rank: int | None
    device: str
    device_id: str | None  # a GPU's UUID: two ranks must not share one
    shared: dict[str, str | None]
    findings: tuple[Finding, ...] = field(default=())


def shared_facts(device: torch.device) -> dict[str, str | None]:
    """Versions, device model and driver, and the environment flags that every rank must agree on."""
    import lightning_solo

    env, on_gpu = os.environ, device.type == "cuda"
    facts: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "lightning_solo": lightning_solo.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        "device": torch.cuda.get_device_name(device) if on_gpu else device.type,
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(device))) if on_gpu else None,
        "driver": _driver_version() if on_gpu else None,
        "cuda_visible_devices": _visible_count(env.get("CUDA_VISIBLE_DEVICES")),
    }
    for name in sorted(env):
        if name.startswith(_AGREED_PREFIXES) and name not in _MAY_DIFFER | _PER_HOST:
            facts[f"env.{name}"] = env[name]
    for name in _AGREED_VARS:
        facts[f"env.{name}"] = env.get(name)
    return facts


def local_facts(device: torch.device, findings: Sequence[Finding] = ()) -> RankFacts:
    """This rank's place (host, local rank, device) and shared facts, and the ``findings`` of its own checks."""
    device_id = None
    if device.type == "cuda":
        device_id = str(getattr(torch.cuda.get_device_properties(device), "uuid", None) or device)
    local = os.environ.get("LOCAL_RANK")
    return RankFacts(
        rank=dist.get_rank() if dist.is_available() and dist.is_initialized() else 0,
        host=socket.gethostname(),
        local_rank=int(local) if local and local.isdigit() else None,
        device=str(device),
        device_id=device_id,
        shared=shared_facts(device),
        findings=tuple(findings),
    )


def _nccl_version() -> str | None:
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
        return None
    return ".".join(map(str, torch.cuda.nccl.version()))


def _driver_version() -> str | None:
    try:  # nvidia-ml-py, optional (the "gpu" extra)
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - not installed, no driver, no permission: the fact is unknown
        return None


def _visible_count(value: str | None) -> str | None:
    if value is None:
        return None
    return str(len([v for v in value.split(",") if v.strip()]))
