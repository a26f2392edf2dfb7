"""Peak memory of one training step at a given per-device batch, as a fraction of a budget. See docs/diagnostics.md."""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import psutil
import torch

from lightning_solo.core import cpu_malloc

# Memory running out besides torch.OutOfMemoryError: a raw cudaMalloc, cuDNN or cuBLAS without a workspace.
_OUT_OF_MEMORY = (
    "out of memory",
    "cudamalloc",
    "unable to find a valid cudnn algorithm",
    "unable to find an engine",
    "cudnn_status_alloc_failed",
    "cublas_status_alloc_failed",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` means the batch did not fit in memory (a probe measures ``inf``)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error).lower() for s in _OUT_OF_MEMORY)


def _status_bytes(field: str) -> int | None:
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return _status_bytes("VmHWM") is not None
    except OSError:
        return False


@contextlib.contextmanager
def _sampled_peak(process: psutil.Process, peak: list[int]) -> Iterator[None]:
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], process.memory_info().rss)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        peak[0] = max(peak[0], process.memory_info().rss)


def _optimizers(config: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in whatever ``configure_optimizers`` returned (schedulers are ignored)."""
    if isinstance(config, torch.optim.Optimizer):
        return [config]
    if isinstance(config, Mapping):
        return _optimizers(config.get("optimizer"))
    if isinstance(config, (list, tuple)):
        return [opt for item in config for opt in _optimizers(item)]
    return []


def _training_steps(pl_module: Any, precision_plugin: Any, batch: Any) -> Any:
    """A training step on ``batch`` with a fresh optimizer of the module's (created at the first step's end)."""
    optimizers = _optimizers(pl_module.configure_optimizers())
    if not optimizers:
        raise ValueError("configure_optimizers() returned no optimizer to probe the training step with")

    def step() -> None:
        with precision_plugin.train_step_context():
            output = pl_module.training_step(batch, 0)
        loss = output["loss"] if isinstance(output, Mapping) else output
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()

    return step


class MemoryProbe:
    """Measures a training step's peak memory on ``device`` as a fraction of the budget."""

    def __init__(self, device: torch.device, cap_bytes: int | None, local_processes: int = 1) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if cap_bytes is None:
            cap_bytes = (
                torch.cuda.get_device_properties(device).total_memory
                if self.cuda
                else psutil.virtual_memory().available // max(1, local_processes)
            )
        self.cap_bytes = int(cap_bytes)
        self.kind = "the GPU's memory" if self.cuda else "the CPU budget (resident memory growth)"
        self._libc = None if self.cuda else cpu_malloc.glibc()
        self._warm = False
        self.reserved = math.nan  # the last probe's reserved peak, as a fraction (GPU only)

    @contextlib.contextmanager
    def session(self, pl_module: Any, trainer: Any) -> Iterator[None]:
        """Around all probes: the module's state, its link to ``trainer`` and the RNG are restored at the end."""
        snapshot = {  # a module's extra state (get_extra_state) is whatever it returns: copied as it is
            k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in pl_module.state_dict().items()
        }
        training = pl_module.training
        devices = [self.device] if self.cuda else []
        # Only the pack's own setting is tuned, and put back: one glibc chose or the user set could not be restored.
        tuned = self._libc if self._libc is not None and cpu_malloc.in_force() else None
        if tuned is not None:
            tuned.mallopt(cpu_malloc.M_MMAP_THRESHOLD, cpu_malloc.START_MMAP_THRESHOLD)
        try:
            with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # self.log without a loop, outside the fit (this block only)
                pl_module.trainer = None
                pl_module.train()
                yield
        finally:
            pl_module.trainer = trainer
            pl_module.train(training)
            pl_module.load_state_dict(snapshot)
            pl_module.zero_grad(set_to_none=True)
            if tuned is not None:
                tuned.mallopt(cpu_malloc.M_MMAP_THRESHOLD, cpu_malloc.MMAP_THRESHOLD)
            if self.cuda:  # the probes' peaks are not the run's: TrainingDoctor reports the fit's own
                torch.cuda.reset_peak_memory_stats(self.device)

    def measure(self, pl_module: Any, precision_plugin: Any, batch: Any) -> float:
        """The peak of a training step on ``batch`` as a fraction of the budget (GPU: the reserved peak's in
        ``self.reserved``); ``inf`` when the memory ran out."""
        self.reserved = math.nan
        try:
            if not self._warm:  # kernels, workspaces and caches set up on first use are no batch's memory
                _training_steps(pl_module, precision_plugin, batch)()
                self._warm = True
            pl_module.zero_grad(set_to_none=True)
            step = _training_steps(pl_module, precision_plugin, batch)
            if self.cuda:
                step()  # unmeasured at this batch size: cuDNN autotunes its convolutions for the new shapes here
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(self.device)
                step()
                self.reserved = torch.cuda.max_memory_reserved(self.device) / self.cap_bytes
                return torch.cuda.max_memory_allocated(self.device) / self.cap_bytes
            return self._cpu_growth(step) / self.cap_bytes
        except RuntimeError as err:  # torch.OutOfMemoryError is one
            if is_out_of_memory(err):
                self.reserved = math.inf
                return math.inf
            raise
        finally:
            step = None  # the optimizer state goes with it
            pl_module.zero_grad(set_to_none=True)
            if self.cuda:
                torch.cuda.empty_cache()

    def _cpu_growth(self, step: Any) -> int:
        process = psutil.Process()
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)
        baseline = process.memory_info().rss
        step()  # allocates the gradients and the optimizer state
        if _reset_high_water_mark():
            step()
            peak = _status_bytes("VmHWM") or 0
        else:
            sampled = [0]
            with _sampled_peak(process, sampled):
                step()
            peak = sampled[0]
        return max(0, peak - baseline)
