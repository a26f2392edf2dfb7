"""ResourceMonitor: every rank's CPU, memory and GPU use, logged as min and max. See docs/diagnostics.md."""

from __future__ import annotations

import math
import time

import lightning as L
import psutil
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_solo.core.checks import check_int, check_number
from lightning_solo.core.decision import Decision, DecisionLog
from lightning_solo.core.ranks import world_size
from lightning_solo.diagnostics.checks.collectives import gather_rows

CPU_KEYS = ("cpu/system_percent", "cpu/process_percent", "memory/rss_gib")
GPU_KEYS = ("gpu/util_percent", "gpu/memory_used_gib")
_GIB = 2**30


def decide_sources(device: torch.device) -> Decision:
    """psutil always; NVML for a CUDA device when it can be read."""
    if device.type != "cuda":
        return Decision("resource_monitor.sources", ["psutil"], f"{device.type} device: CPU and RSS via psutil")
    try:
        torch.cuda.utilization(device)
    except Exception as err:  # noqa: BLE001 - nvidia-ml-py missing, no driver access: GPU values stay NaN
        return Decision(
            "resource_monitor.sources",
            ["psutil"],
            f"NVML unavailable ({type(err).__name__}: {err}); install lightning_solo[gpu] (nvidia-ml-py) for GPU "
            "utilisation and memory",
        )
    return Decision("resource_monitor.sources", ["psutil", "nvml"], "GPU utilisation and memory via NVML")


class ResourceSampler:
    """Samples :attr:`keys` in order. CPU percentages are averages since the previous sample (psutil's)."""

    def __init__(self, device: torch.device, nvml: bool) -> None:
        self.device, self.nvml = device, nvml
        self.keys = CPU_KEYS + (GPU_KEYS if device.type == "cuda" else ())
        self._process = psutil.Process()
        psutil.cpu_percent(None)  # the first call only starts the interval
        self._process.cpu_percent(None)

    def sample(self) -> list[float]:
        values = [psutil.cpu_percent(None), self._process.cpu_percent(None), self._process.memory_info().rss / _GIB]
        if self.device.type == "cuda":
            values += self._gpu() if self.nvml else [math.nan, math.nan]
        return values

    def _gpu(self) -> list[float]:
        try:
            return [float(torch.cuda.utilization(self.device)), torch.cuda.device_memory_used(self.device) / _GIB]
        except Exception:  # noqa: BLE001 - a driver hiccup must not stop training: report unknown
            return [math.nan, math.nan]


def decide_every_n_steps(interval_s: float, seconds_per_step: float, measured_over: int) -> Decision:
    """How many optimizer steps make ``interval_s`` at the measured pace (at least 1)."""
    steps = max(1, round(interval_s / seconds_per_step)) if seconds_per_step > 0 else 1
    return Decision(
        "resource_monitor.every_n_steps",
        steps,
        f"~{interval_s:g} s at {seconds_per_step:.3g} s/step (slowest rank, measured over {measured_over} steps)",
    )


class ResourceMonitor(DecisionLog, L.Callback):
    def __init__(self, interval_s: float = 30.0, every_n_steps: int | None = None, calibration_steps: int = 5) -> None:
        self.interval_s = check_number("interval_s", interval_s)
        self.every_n_steps = check_int("every_n_steps", every_n_steps, optional=True)
        self.calibration_steps = check_int("calibration_steps", calibration_steps)
        self.decisions: dict[str, Decision] = {}
        self.peaks: dict[str, float] = {}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        sources = self._decide(decide_sources(device))
        self._sampler = ResourceSampler(device, nvml="nvml" in sources.value)
        self._every = self.every_n_steps
        if self._every is not None:
            self._decide(Decision("resource_monitor.every_n_steps", self._every, "set by the user"))
        self._calibration: tuple[int, float] | None = None
        self._next = trainer.global_step + (self._every or 0)
        self._last_sampled: int | None = None

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        step = trainer.global_step  # optimizer steps done: the same on every rank after every batch
        if self._every is None:
            self._calibrate(trainer, step)
        elif step >= self._next:
            self._next = step + self._every
            self._sample(trainer, step)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last_sampled != trainer.global_step:
            self._sample(trainer, trainer.global_step)

    def _calibrate(self, trainer: L.Trainer, step: int) -> None:
        if self._calibration is None:
            if step >= 1:  # the first step (allocation, DDP's bucket rebuild) is not the pace
                self._calibration = (step, time.perf_counter())
            return
        start, started = self._calibration
        if step - start < self.calibration_steps:
            return
        pace = torch.tensor([(time.perf_counter() - started) / (step - start)], device=trainer.strategy.root_device)
        if world_size() > 1:
            dist.all_reduce(pace, op=dist.ReduceOp.MAX)
        self._every = self._decide(decide_every_n_steps(self.interval_s, pace.item(), step - start)).value
        self._next = step
        self._sample(trainer, step)

    def _sample(self, trainer: L.Trainer, step: int) -> None:
        self._last_sampled = step
        mine = torch.tensor(self._sampler.sample(), dtype=torch.float64, device=trainer.strategy.root_device)
        every = gather_rows(mine)
        metrics: dict[str, float] = {}
        for key, column in zip(self._sampler.keys, every.T.tolist()):
            known = [v for v in column if not math.isnan(v)]
            if not known:
                continue
            metrics[f"system/{key}_min"], metrics[f"system/{key}_max"] = min(known), max(known)
            self.peaks[key] = max(self.peaks.get(key, -math.inf), max(known))
        if trainer.is_global_zero and metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
