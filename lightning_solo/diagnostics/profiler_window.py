"""ProfilerWindow: torch's profiler over a window of batches, one trace per global rank. See docs/diagnostics.md."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from torch.profiler import ProfilerActivity, profile, schedule
from typing_extensions import override

from lightning_solo.core.checks import check_bool, check_int


class ProfilerWindow(L.Callback):
    """torch's profiler over ``wait``/``warmup``/``active`` batches (arguments: docs/diagnostics.md)."""

    def __init__(
        self,
        dirpath: str | None = None,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        self.dirpath = dirpath
        self.wait = check_int("wait", wait, minimum=0)
        self.warmup = check_int("warmup", warmup, minimum=0)
        self.active = check_int("active", active)
        self.record_shapes = check_bool("record_shapes", record_shapes)
        self.profile_memory = check_bool("profile_memory", profile_memory)
        self.with_stack = check_bool("with_stack", with_stack)
        self.trace_path: Path | None = None
        self._profiler: profile | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trace_path = Path(self.dirpath or Path(trainer.default_root_dir) / "profile") / (
            f"trace_rank{trainer.global_rank}.json"
        )
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=lambda prof: prof.export_chrome_trace(str(self.trace_path)),
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self._profiler.start()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if self._profiler is None:
            return
        self._profiler.step()
        if self._profiler.step_num >= self.wait + self.warmup + self.active:  # the trace is written: stop paying for it
            self._stop()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()  # a fit shorter than the window still writes what it recorded

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()  # writes the trace if the window was recording
