"""Every runtime patch the pack makes to a Lightning or torch object goes through :class:`Patches`, which sets an
attribute (or an object's class), remembers what was there, and undoes all of it, newest first, when closed. The
upstream names replaced are listed in :data:`PATCHED`; tests/test_compat.py checks that each still exists.
Checked on lightning 2.6.6 and torch 2.14.1 (and lightning 2.6.0 with torch 2.11.0)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.data import DataLoader

_MISSING = object()

# The upstream attributes replaced at run time (on one instance, a class or a module), by owner.
PATCHED: dict[Any, tuple[str, ...]] = {
    DataLoader: ("_get_iterator",),  # a loader's own, for the SIGTERM shield and the agreed end of uneven data
    torch_checkpoint.CheckpointFunction: ("apply",),  # non-reentrant while the unused policy searches
    _TrainingEpochLoop: ("_broadcast_sigterm_tensor", "on_advance_end", "reset"),  # one trainer's: SIGTERM, resume
    _EvaluationLoop: ("_evaluation_step",),
    _FitLoop: ("on_advance_end",),
    # one module's: eager log/log_dict inside its compiled steps (compile=); lr_scheduler_step held on a step the
    # GradScaler skipped (skip_lr_on_overflow)
    LightningModule: ("log", "log_dict", "lr_scheduler_step"),
    _SignalConnector: ("_sigterm_notifier_fn",),
    dist: (
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
        "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce",
        "gather", "scatter", "barrier", "send", "recv", "isend", "irecv",
    ),  # watched while the unused policy's evidence window is open
    dist.distributed_c10d: ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "gather", "scatter", "barrier", "send", "recv", "isend", "irecv"),  # the same, where torch defines them
}  # fmt: skip


class Patches:
    """Set attributes on upstream objects, and undo them all, newest first, at :meth:`close` (or on leaving
    ``with``). Undoing restores the previous value, or removes an attribute that was only inherited."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, undone at :meth:`close`. ``name="__class__"`` changes an object's class."""
        previous = type(owner) if name == "__class__" else vars(owner).get(name, _MISSING)
        setattr(owner, name, value)
        self._undo.append((owner, name, previous))

    def close(self) -> None:
        while self._undo:
            owner, name, previous = self._undo.pop()
            if previous is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, previous)

    def __enter__(self) -> Patches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` for the block, undone on leaving it, whatever happens."""
    with Patches() as patches:
        patches.set(owner, name, value)
        yield
