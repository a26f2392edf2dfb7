"""What a rank's training thread does between SoloDDP's phases, read off its Python stack by the watchdog thread."""

from __future__ import annotations

import sys
from types import FrameType

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo._compat import torch as torch_compat
from lightning_solo.checkpoint.background import BackgroundWriter
from lightning_solo.ddp.watchdog.heartbeat import CHECKPOINT_WRITE

LOADER_START = "loader start"  # a loader's first batch of an epoch: its workers start (worker_init_fn) and fetch
# Hooks that are a step's or a batch's own work: the phase SoloDDP's hooks marked stands.
STEP_HOOKS = frozenset({
    "training_step", "validation_step", "test_step", "predict_step", "backward", "optimizer_step",
    "optimizer_zero_grad", "lr_scheduler_step", "on_before_batch_transfer", "transfer_batch_to_device",
    "on_after_batch_transfer", "batch_to_device", "on_train_batch_start", "on_validation_batch_start",
    "on_test_batch_start", "on_predict_batch_start", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad", "on_validation_model_eval", "on_validation_model_train",
})  # fmt: skip
# Hooks that run once per fit: every one is a first occurrence.
ONCE_HOOKS = frozenset({
    "setup", "configure_model", "on_fit_start", "on_train_start", "on_train_end", "on_fit_end", "teardown",
    "on_sanity_check_start", "on_sanity_check_end",
})  # fmt: skip
_HOOK_CODES = lightning_compat.hook_call_codes()
_NEXT_CODE = torch_compat.dataloader_next_code()
_START_CODES = torch_compat.dataloader_start_codes()
_WRITE_WAIT = BackgroundWriter.wait.__code__
_DEPTH = 200  # frames looked at, innermost first


def where(frame: FrameType | None) -> str | None:
    """The innermost Lightning hook on the stack (``None`` for a step's own), or :data:`LOADER_START`; else ``None``."""
    for _ in range(_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        if code is _WRITE_WAIT:
            return CHECKPOINT_WRITE
        if code in _START_CODES:
            return LOADER_START
        if code is _NEXT_CODE:
            first = torch_compat.batches_yielded(frame.f_locals.get("self")) == 0
            return LOADER_START if first else None
        if code in _HOOK_CODES:
            name = frame.f_locals.get("hook_name")
            return name if isinstance(name, str) and name not in STEP_HOOKS else None
        frame = frame.f_back
    return None


def thread_frame(ident: int | None) -> FrameType | None:
    """The current frame of the thread ``ident`` (``None``: gone)."""
    return sys._current_frames().get(ident) if ident is not None else None
