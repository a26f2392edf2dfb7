"""The machine check behind ``python -m lightning_solo.preflight``: this process's launch, and under a launcher
every rank's facts gathered and compared, without training."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_solo.diagnostics.checks import agreement
from lightning_solo.diagnostics.checks.collectives import gather_objects
from lightning_solo.diagnostics.checks.facts import RankFacts, local_facts
from lightning_solo.diagnostics.checks.finding import Finding
from lightning_solo.diagnostics.checks.launch_env import check_backend, check_launch_env


def check_machine(
    backend: str | None = None, timeout_s: float = 120, ignore: Sequence[str] = ()
) -> tuple[list[RankFacts], list[Finding]]:
    """This process's launch variables and backend; under a launcher, every rank's facts gathered and compared
    and a test all-reduce. Returns (every rank's facts, findings), the same on every rank."""
    rank, world, local_rank, address, port = launch_placement()
    on_gpu = torch.cuda.is_available()
    gpus_visible = torch.cuda.device_count() if on_gpu else None
    device = preflight_device(local_rank, gpus_visible)
    backend = backend or ("nccl" if on_gpu else "gloo")
    found = check_launch_env(os.environ, gpus_visible=gpus_visible)
    if (mismatch := check_backend(backend, device.type)) is not None:
        found.append(mismatch)
    if world > 1 and not any(f.error for f in found):  # a rank with broken variables would not meet the others
        if on_gpu:
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
    try:
        every = gather_objects(local_facts(device, found))
        findings = agreement.check(every, ignore)
        if dist.is_initialized():
            total = torch.tensor([rank + 1.0], device=device)
            dist.all_reduce(total)
            expected = world * (world + 1) / 2
            if total.item() != expected:
                findings.append(Finding("allreduce", f"a test all-reduce gave {total.item()}, not {expected}", True))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return every, findings


def preflight_device(local_rank: int | None, gpus_visible: int | None) -> torch.device:
    """This rank's GPU, or the CPU without one (``LOCAL_RANK`` past the visible GPUs: check_launch_env says so)."""
    index = local_rank or 0
    return torch.device("cuda", index) if gpus_visible and index < gpus_visible else torch.device("cpu")


def launch_placement() -> tuple[int, int, int | None, str | None, int | None]:
    """(rank, world size, local rank, main address, port) from ``RANK``/``WORLD_SIZE`` (torchrun), else SLURM's."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = os.environ
    if env.get("RANK", "").isdigit() and env.get("WORLD_SIZE", "").isdigit():
        local, port = env.get("LOCAL_RANK", ""), env.get("MASTER_PORT", "")
        return (int(env["RANK"]), int(env["WORLD_SIZE"]), int(local) if local.isdigit() else None,
                env.get("MASTER_ADDR"), int(port) if port.isdigit() else None)  # fmt: skip
    if SLURMEnvironment.detect():
        slurm = SLURMEnvironment(auto_requeue=False)
        return slurm.global_rank(), slurm.world_size(), slurm.local_rank(), slurm.main_address, slurm.main_port
    return 0, 1, None, None, None


def format_report(every: Sequence[RankFacts], findings: Sequence[Finding]) -> str:
    """One line per fact (its value, or DIFFERS), then the findings."""
    hosts = sorted({f.host for f in every})
    lines = [f"lightning_solo preflight: {len(every)} rank(s) on {len(hosts)} host(s) ({', '.join(hosts)})"]
    if len(every) == 1:
        lines.append("  one process: run it under torchrun or srun to compare the ranks of an allocation")
    keys = sorted({k for f in every for k in f.shared})
    width = max(map(len, keys), default=0)
    for key in keys:
        values = {f.shared.get(key) for f in every}
        lines.append(f"  {key.ljust(width)}  {values.pop() if len(values) == 1 else 'DIFFERS (below)'}")
    lines += [f"  {f}" for f in findings]
    errors = sum(f.error for f in findings)
    verdict = "FAILED" if errors else "passed"
    lines.append(f"preflight {verdict}: {errors} error(s), {len(findings) - errors} warning(s)")
    return "\n".join(lines)
