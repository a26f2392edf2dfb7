"""What one process uses now: CPU, resident memory and, on GPU, the device's utilisation and memory through
NVML (``nvidia-ml-py``, the ``gpu`` extra)."""

from __future__ import annotations

import math

import psutil
import torch

from lightning_solo.core.decision import Decision

CPU_KEYS = ("cpu/system_percent", "cpu/process_percent", "memory/rss_gib")
GPU_KEYS = ("gpu/util_percent", "gpu/memory_used_gib")
_GIB = 2**30


def decide_sources(device: torch.device) -> Decision:
    """psutil always; NVML for a CUDA device when it can be read (torch maps the device through it)."""
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
