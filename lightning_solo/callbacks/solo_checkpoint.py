"""SoloCheckpoint: Lightning's ModelCheckpoint made rank-symmetric, crash-safe and exception-safe, optionally
written in the background. See docs/checkpoints.md."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import statistics
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.checkpoint.background import BackgroundWriter, decide_async_save
from lightning_solo.checkpoint.io import SoloCheckpointIO, _fsync_dir, clean_stale_temp_files
from lightning_solo.checkpoint.manifest import read_manifest
from lightning_solo.checkpoint.sharded import read_sharded_manifest
from lightning_solo.core.checks import check_int, check_number
from lightning_solo.core.decision import Decision, DecisionLog

log = logging.getLogger(__name__)


class SoloCheckpoint(DecisionLog, ModelCheckpoint):
    """A :class:`~lightning.pytorch.callbacks.ModelCheckpoint` (all its arguments work) that is rank-symmetric,
    crash-safe and exception-safe. See docs/checkpoints.md.

    Args:
        keep_last_k: keep the ``k`` newest checkpoints by global step (not with ``monitor``).
        save_last: ``True`` by default: ``last.ckpt`` is what auto-resume and humans look for.
        save_on_exception: rank 0 writes ``on_exception.ckpt`` from its own state, with no collective.
        exception_save_timeout_s: how long that save may take before it is abandoned.
        async_save: ``True``: written by a background thread; ``"auto"``: if the first save blocked over two steps.
        async_timeout_s: how long the fit's end, an exception or a requeue waits for a background write.
    """

    EXCEPTION_NAME = "on_exception"

    # ModelCheckpoint's arguments are spelled out (not **kwargs) so that config checks see a typo.
    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | Literal["link"] | None = True,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        *,
        keep_last_k: int | None = None,
        exception_save_timeout_s: float = 60.0,
        async_save: bool | Literal["auto"] = False,
        async_timeout_s: float = 600.0,
    ) -> None:
        if keep_last_k is not None:
            check_int("keep_last_k", keep_last_k)
            if monitor is not None:
                raise ValueError(
                    f"keep_last_k cannot be combined with monitor={monitor!r}; save_top_k keeps the best k"
                )
            if save_top_k != 1 or mode != "min":
                raise ValueError("keep_last_k sets save_top_k and mode itself; pass keep_last_k or save_top_k/mode")
            monitor, mode, save_top_k = "step", "max", keep_last_k
        if save_last not in (True, False, None, "link"):
            raise ValueError(f"save_last must be True, False, None or 'link', got {save_last!r}")
        check_number("exception_save_timeout_s", exception_save_timeout_s)
        if async_save not in (True, False, "auto"):
            raise ValueError(f"async_save must be True, False or 'auto', got {async_save!r}")
        check_number("async_timeout_s", async_timeout_s)
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            verbose=verbose,
            save_last=save_last,
            save_top_k=save_top_k,
            save_on_exception=save_on_exception,
            save_weights_only=save_weights_only,
            mode=mode,
            auto_insert_metric_name=auto_insert_metric_name,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=enable_version_counter,
        )
        self.keep_last_k = keep_last_k
        self.exception_save_timeout_s = float(exception_save_timeout_s)
        self.decisions: dict[str, Decision] = {}
        self.exception_checkpoint_path: str | None = None
        self.async_save = async_save
        self.async_timeout_s = float(async_timeout_s)
        self._writer: BackgroundWriter | None = None
        self._group_depth = 0
        self._auto: dict[str, Any] | None = None  # async_save="auto" until decided: step starts, save time

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        io = trainer.strategy.checkpoint_io
        if isinstance(io, SoloCheckpointIO):
            self._decide(Decision("checkpoint_io", "SoloCheckpointIO", "atomic same-directory writes, fsync, manifest"))
        else:
            self._decide(Decision("checkpoint_io", type(io).__name__, "set by the user"))
            rank_zero_warn(
                f"SoloCheckpoint with {type(io).__name__}: writes are not atomic and carry no manifest;"
                " use SoloDDP (or plugins=[SoloCheckpointIO()]) for crash-safe checkpoints"
            )
        self._writer, self._auto = None, None
        if self.async_save == "auto" and isinstance(io, SoloCheckpointIO) and stage == "fit":
            self._auto = {"starts": [], "save_s": 0.0}
            self._decide(Decision("async_save", "auto", "the first save is timed against the step time"))
        elif not self.async_save:
            self._decide(Decision("async_save", False, "every rank waits until rank 0 has written (default)"))
        elif isinstance(io, SoloCheckpointIO) and stage == "fit":
            self._writer = BackgroundWriter()  # every rank's: SoloFSDP's ranks write their shards
            self._decide(Decision("async_save", True, "host snapshot at the save, written by a background thread"))
        else:
            self._decide(Decision("async_save", False, "set, but it needs SoloCheckpointIO; saving synchronously"))
        if trainer.is_global_zero and self.dirpath is not None and os.path.isdir(self.dirpath):
            stale_after_s = io.stale_after_s if isinstance(io, SoloCheckpointIO) else 3600.0
            removed = clean_stale_temp_files(self.dirpath, stale_after_s)
            if removed:
                self._decide(Decision("stale_temp_files", len(removed), "left by a writer that crashed; removed"))

    @override
    def check_monitor_top_k(self, trainer, current: torch.Tensor | None = None) -> bool:
        # The ranks agree that the metric is there first: the parent's collective comes after its early return.
        if not trainer.strategy.reduce_boolean_decision(current is not None, all=True):
            return False
        return super().check_monitor_top_k(trainer, current)

    @contextlib.contextmanager
    def _group(self, trainer=None) -> Iterator[None]:  # one hook's writes, removals and link: written after it
        self._group_depth += 1
        try:
            yield
        finally:
            self._group_depth -= 1
            if self._group_depth == 0 and self._writer is not None:
                self._writer.submit()
            elif self._group_depth == 0 and self._auto is not None and self._auto["save_s"] and trainer is not None:
                self._decide_auto(trainer)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._auto is not None:
            self._auto["starts"] = [*self._auto["starts"][-16:], time.perf_counter()]

    def _decide_auto(self, trainer) -> None:
        auto = self._auto
        assert auto is not None
        steps = [b - a for a, b in itertools.pairwise(auto["starts"][1:])]  # the first may include the loader's start
        if not steps:  # a save before three steps ran: decide at the next one
            auto["save_s"] = 0.0
            return
        self._auto = None
        measured = trainer.strategy.broadcast((auto["save_s"], statistics.median(steps)))  # rank 0's, on every rank
        if self._decide(decide_async_save(*measured)).value:
            self._writer = BackgroundWriter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with self._group(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def _save_checkpoint(self, trainer, filepath: str) -> None:
        writer, io = self._writer, trainer.strategy.checkpoint_io
        if self._auto is not None:  # timed: the first save decides async_save="auto"
            start = time.perf_counter()
            with self._group(trainer):
                super()._save_checkpoint(trainer, filepath)
                self._auto["save_s"] += time.perf_counter() - start
            return None
        if writer is None or not isinstance(io, SoloCheckpointIO):
            return super()._save_checkpoint(trainer, filepath)
        # Before the save's collectives and per-rank files: at most one save in flight, its buffers reused. The
        # other ranks wait for rank 0's write in a barrier (the watchdog sees who waits for what).
        writer.wait(None, "the next save")
        trainer.strategy.barrier("background checkpoint write")
        with self._group(), io.staging(writer):
            super()._save_checkpoint(trainer, filepath)

    def wait_for_write(self, why: str) -> None:
        """The fit's end, an exception, a SLURM requeue: wait (at most ``async_timeout_s``) for the write in flight;
        say so if it is still going."""
        writer = self._writer
        if writer is None:
            return
        pending = writer.in_flight
        if not writer.wait(self.async_timeout_s, why):
            error = "the background checkpoint write of %s did not finish within async_timeout_s=%.0f s (%s); it was"
            log.error(
                error + " told to stop; a resume uses the newest committed one", pending, self.async_timeout_s, why
            )
        self._decide(Decision("async_save_waits", dict(writer.stats), "background writes and the waits for them"))

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if self._writer is not None:  # before the strategy's teardown; the others in a barrier, as at a save
            self.wait_for_write("the fit ended")
            trainer.strategy.barrier("background checkpoint write")

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._writer = None
        super().teardown(trainer, pl_module, stage)

    # Lightning 2.6 writes `last` only in a step where it also wrote a top-k checkpoint, so once the monitored
    # metric stops improving `last` falls behind and a resume would lose that work. Both hooks run on every
    # rank (the save is collective).
    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        with self._group(trainer):
            super().on_validation_end(trainer, pl_module)
            if not self._should_save_on_train_epoch_end(trainer):
                self._refresh_last(trainer)

    @override
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        with self._group(trainer):
            super().on_train_epoch_end(trainer, pl_module)
            if self._should_save_on_train_epoch_end(trainer):
                self._refresh_last(trainer)

    @override
    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_saved_step = trainer.global_step

    def _refresh_last(self, trainer) -> None:
        done = getattr(self, "_last_saved_step", None) == trainer.global_step
        if self.save_last and not (
            trainer.fast_dev_run or trainer.sanity_checking or trainer.state.fn != "fit" or done
        ):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        successor = self._last_checkpoint_saved

        def remove() -> None:
            if trainer.is_global_zero and not _intact(trainer, successor, filepath):
                rank_zero_warn(f"keeping {filepath!r}: its successor {successor!r} is missing or damaged")
                return
            super(SoloCheckpoint, self)._remove_checkpoint(trainer, filepath)

        self._run_or_queue(remove, trainer)

    def _run_or_queue(self, op: Any, trainer) -> None:  # rotation and link run after the write before them
        if self._writer is None:
            op()
        else:
            with self._group():
                self._writer.add(op)

    @override
    def _link_checkpoint(self, trainer, filepath: str, linkpath: str) -> None:  # type: ignore[override]
        # The parent removes the old link and then creates the new one; a crash in between leaves no
        # `last` at all. A new link under a temporary name, renamed over the old one, is atomic.
        self._run_or_queue(lambda: _swap_link(trainer, filepath, linkpath), trainer)
        trainer.strategy.barrier()

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Not the parent's: its barrier and all-reduce on the failing rank alone hang until the timeout (#20187).
        self.wait_for_write(f"{type(exception).__name__} raised")
        if not self._should_save_on_exception(trainer) or not trainer.is_global_zero or self.dirpath is None:
            return
        if trainer.world_size > 1 and not torch.distributed.is_initialized():
            return  # the parent of fork/spawn workers: it holds no training state of this fit
        path = os.path.join(self.dirpath, self.EXCEPTION_NAME + self.FILE_EXTENSION)
        outcome: dict[str, BaseException | None] = {}

        def save() -> None:
            try:
                checkpoint = lightning_compat.dump_checkpoint(trainer, self.save_weights_only)
                if hasattr(trainer.strategy, "add_resume_state"):  # SoloDDP: what every other checkpoint carries
                    trainer.strategy.add_resume_state(checkpoint, collective=False)
                io = trainer.strategy.checkpoint_io
                note = {"trigger": "exception", "exception": f"{type(exception).__name__}: {exception}"[:500]}
                io.save_checkpoint(checkpoint, path, storage_options=note if isinstance(io, SoloCheckpointIO) else None)
                outcome["error"] = None
            except BaseException as err:  # noqa: BLE001 - reported below; the original exception wins
                outcome["error"] = err

        # A thread: a hook inside dump_checkpoint may wait on the other ranks; the exception must surface even then.
        worker = threading.Thread(target=save, name="solo-exception-checkpoint", daemon=True)
        worker.start()
        worker.join(worker_timeout := self.exception_save_timeout_s)
        if "error" not in outcome:
            log.warning("gave up saving %s after %.0f s (a hook waited on other ranks)", path, worker_timeout)
        elif outcome["error"] is not None:
            log.warning("could not save %s: %r", path, outcome["error"])
        else:
            self.exception_checkpoint_path = path
            log.warning("saved %s after %s: %s", path, type(exception).__name__, exception)


def _swap_link(trainer, filepath: str, linkpath: str) -> None:
    if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
        if os.path.isdir(linkpath) and not os.path.islink(linkpath):
            raise ValueError(f"cannot replace directory {linkpath!r} with a link to the last checkpoint")
        tmp = f"{linkpath}.{os.getpid()}.link-tmp"
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), tmp)
        os.replace(tmp, linkpath)
        _fsync_dir(os.path.dirname(os.path.abspath(linkpath)))  # the swap itself must survive a power loss


def _intact(trainer, successor: str | None, filepath: str) -> bool:
    if not successor or os.path.abspath(successor) == os.path.abspath(filepath):
        return False
    if os.path.isdir(successor):  # a sharded checkpoint (SoloFSDP): swapped in whole once complete
        return read_sharded_manifest(successor) is not None
    if not os.path.isfile(successor):
        return False
    if isinstance(trainer.strategy.checkpoint_io, SoloCheckpointIO):  # verified before its rename: not truncated since
        return read_manifest(successor) is not None
    return os.path.getsize(successor) > 0
