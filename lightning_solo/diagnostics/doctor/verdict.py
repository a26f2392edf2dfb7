"""The doctor's verdict (pure): times per rank → what bounds the run and the remedies. See docs/diagnostics.md."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

BOUNDS = ("data", "communication", "compute", "straggler")
MIN_GAIN = 0.02  # a remedy expected to save less than 2% of the step is noise, not advice


@dataclass(frozen=True)
class RankTimes:
    """One rank's mean time per optimizer step, in milliseconds."""

    data_ms: float
    compute_ms: float
    comm_ms: float
    optimizer_ms: float = 0.0

    @property
    def busy_ms(self) -> float:
        """The rank's own work: everything but waiting in communication."""
        return self.data_ms + self.compute_ms + self.optimizer_ms

    @property
    def step_ms(self) -> float:
        return self.busy_ms + self.comm_ms


@dataclass(frozen=True)
class Setup:
    """What the remedies depend on, read from the running trainer (the same on every rank)."""

    device: str = "cpu"  # "cpu" | "cuda"
    world_size: int = 1
    per_device_batch: int | None = None
    accumulate: int = 1
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    idle_cores: int = 0  # per process: cores neither the process nor its loader workers use
    comm_hook: str | None = None
    hook_times_ms: dict[str, float] | None = None  # comm_hook="auto"'s measured ms/step per candidate
    bucket_count: int = 0
    gradient_mib: float = 0.0
    bucket_cap_mb: float = 25.0
    overlap_fraction: float | None = None  # share of DDP's communication that overlapped backward
    memory_fraction: float | None = None  # peak memory / device memory, the fullest rank
    precision: str = "32-true"


@dataclass(frozen=True)
class Remedy:
    """The library ``setting`` (``"DataLoader.num_workers"``) set to ``value``; ``None``: no setting does it."""

    setting: str | None
    value: Any
    action: str
    gain: float  # expected saving, as a fraction of the step


def setting_call(setting: str | None, value: Any) -> str:
    """``"DataLoader.num_workers", 3`` as the call that applies it, ``DataLoader(num_workers=3)``; None: no setting."""
    if not setting:
        return "(no setting)"
    owner, _, argument = setting.partition(".")
    return f"{owner}({argument}={value!r})"


@dataclass(frozen=True)
class Verdict:
    bound: str
    shares: dict[str, float]
    straggler: int | None  # the slowest rank
    behind_ms: float  # how far its own work is behind the others'
    remedies: tuple[Remedy, ...] = field(default_factory=tuple)

    def __str__(self) -> str:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(self.shares.items(), key=lambda kv: -kv[1]))
        return f"{self.bound}-bound ({shares})"


def diagnose(ranks: Sequence[RankTimes], setup: Setup) -> Verdict:
    """The bound of a run measured as ``ranks`` (one entry per rank) and the remedies, best first."""
    if not ranks:
        raise ValueError("diagnose needs the times of at least one rank")
    step = statistics.fmean(r.step_ms for r in ranks)
    slowest = max(range(len(ranks)), key=lambda r: ranks[r].busy_ms)
    others = [r for i, r in enumerate(ranks) if i != slowest] or list(ranks)
    behind = max(0.0, ranks[slowest].busy_ms - statistics.median(r.busy_ms for r in others))
    typical = RankTimes(*(statistics.fmean(getattr(r, f.name) for r in others) for f in fields(RankTimes)))
    if step <= 0:
        return Verdict("compute", dict.fromkeys(BOUNDS, 0.0), None, 0.0)
    shares = {
        "data": typical.data_ms / step,
        "communication": ranks[slowest].comm_ms / step,
        "compute": (typical.compute_ms + typical.optimizer_ms) / step,
        "straggler": behind / step if len(ranks) > 1 else 0.0,
    }
    bound = max(shares, key=shares.__getitem__)
    remedies = [
        *_data_remedies(shares["data"], setup),
        *_comm_remedies(shares["communication"], typical.optimizer_ms / step, setup),
        *_straggler_remedies(shares["straggler"], slowest, behind, ranks, typical, setup),
        *_compute_remedies(shares["compute"], setup),
    ]
    remedies = sorted((r for r in remedies if r.gain >= MIN_GAIN), key=lambda r: -r.gain)
    return Verdict(bound, shares, slowest if len(ranks) > 1 else None, behind, tuple(remedies))


def _data_remedies(share: float, setup: Setup) -> list[Remedy]:
    out = []
    if setup.num_workers == 0:
        # Even without an idle core, one worker overlaps loading (often I/O) with the step.
        workers, gain = max(1, min(setup.idle_cores, 4)), (0.9 if setup.idle_cores else 0.5) * share
        action = "load batches in worker processes, while the step runs"
        out.append(Remedy("DataLoader.num_workers", workers, action, gain))
    elif setup.idle_cores > 0:
        workers = min(2 * setup.num_workers, setup.num_workers + setup.idle_cores)
        action = f"more loader workers ({setup.idle_cores} cores per process are idle)"
        out.append(Remedy("DataLoader.num_workers", workers, action, 0.5 * share))
    else:
        action = "no idle cores for more loader workers: make samples cheaper to load (decode once and cache, augment on the device)"
        out.append(Remedy(None, None, action, 0.5 * share))
    if setup.num_workers > 0 and (setup.prefetch_factor or 2) < 4:
        action = "each worker keeps more batches ready, smoothing slow samples"
        out.append(Remedy("DataLoader.prefetch_factor", 4, action, 0.3 * share))
    if setup.device == "cuda" and not setup.pin_memory:
        action = "page-locked batches copy to the GPU faster and asynchronously"
        out.append(Remedy("DataLoader.pin_memory", True, action, 0.2 * share))
    return out


def _comm_remedies(share: float, optimizer_share: float, setup: Setup) -> list[Remedy]:
    if setup.world_size < 2:
        return []
    out = []
    # The all-reduce costs the same per step whatever the batch: twice the work per step halves its share.
    per_step = (share + optimizer_share) / 2
    full = setup.memory_fraction is not None and setup.memory_fraction > 0.45
    if setup.per_device_batch and not full:
        action = "twice the work per all-reduce (WarmupScaledLR rescales the learning rate to the global batch)"
        out.append(Remedy("DataLoader.batch_size", 2 * setup.per_device_batch, action, per_step))
    action = "one all-reduce per two batches, when the batch cannot grow in memory (the global batch doubles)"
    out.append(Remedy("Trainer.accumulate_grad_batches", 2 * setup.accumulate, action, 0.9 * per_step))
    if setup.comm_hook != "post_local_sgd":
        # Saves 3 all-reduces in 4, but changes the optimisation: counted at half, for the accuracy it may cost.
        action = "local steps, parameters averaged every 4 steps: skips most all-reduces, changes the optimisation (check accuracy)"
        out.append(Remedy("SoloDDP.comm_hook", "post_local_sgd", action, 0.75 * share / 2))
    if setup.bucket_count == 1 and setup.gradient_mib > 4 and (setup.overlap_fraction or 0.0) < 0.5:
        action = "smaller gradient buckets start the all-reduce while backward is still running"
        out.append(Remedy("SoloDDP.bucket_cap_mb", max(1, round(setup.gradient_mib / 4)), action, 0.5 * share))
    elif setup.bucket_count > 16 and setup.gradient_mib / setup.bucket_count < 1:
        action = "fewer, larger buckets pay the all-reduce latency fewer times"
        out.append(Remedy("SoloDDP.bucket_cap_mb", 4 * setup.bucket_cap_mb, action, 0.2 * share))
    if _compression_may_pay(setup):
        action = "measure exact, fp16, bf16 and PowerSGD all-reduce for a few steps each and keep the fastest"
        out.append(Remedy("SoloDDP.comm_hook", "auto", action, 0.4 * share))
    return out


def _compression_may_pay(setup: Setup) -> bool:
    """On GPUs without a hook yet, unless "auto" measured compression slower."""
    if setup.device != "cuda" or setup.comm_hook is not None:
        return False
    if setup.hook_times_ms:
        exact = setup.hook_times_ms.get("exact")
        return exact is not None and min(setup.hook_times_ms.values()) < exact
    return True


def _straggler_remedies(
    share: float, slowest: int, behind: float, ranks: Sequence[RankTimes], typical: RankTimes, setup: Setup
) -> list[Remedy]:
    slow = ranks[slowest]  # one rank: no excess, a share of 0 (no remedy)
    excess = {f: getattr(slow, f) - getattr(typical, f) for f in ("data_ms", "compute_ms", "optimizer_ms")}
    where = max(excess, key=excess.__getitem__)
    if where == "data_ms":
        action = f"rank {slowest} waits {excess[where]:.1f} ms per step longer for data than the others: more workers, or check its node's disk and CPU load"
        return [Remedy("DataLoader.num_workers", max(1, 2 * setup.num_workers), action, 0.8 * share)]
    action = f"rank {slowest} is {behind:.1f} ms per step slower than the others: check its device and node (clocks, temperature, other processes)"
    return [Remedy(None, None, action, share)]


def _compute_remedies(share: float, setup: Setup) -> list[Remedy]:
    if setup.device == "cuda" and setup.precision.startswith("32"):
        action = "bf16 (or fp16) mixed precision: tensor cores, half the activation memory"
        return [Remedy("SoloDDP.precision", "auto", action, 0.3 * share)]
    return []
