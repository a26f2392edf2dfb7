"""SIGTERM noticed on any rank stops every rank at the same batch, with no collective on the training stream, and
saves a checkpoint the run resumes from. See docs/sigterm.md."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from lightning_solo._compat.patch import Patches
from lightning_solo.checkpoint.io import SoloCheckpointIO
from lightning_solo.checkpoint.select import checkpoint_dir
from lightning_solo.core.checks import check_bool
from lightning_solo.core.decision import Decision
from lightning_solo.ddp.agreement import Agreement

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "on_sigterm.ckpt"
# Lightning's stops on one rank, each at the end of the method named: deferred to the agreement. With one rank
# there is nothing to agree on (Lightning makes no per-batch check then): the training batch's and the epoch's stop
# there, with the checkpoint; the validation batch's waits for the training batch's.
_LOCAL_STOPS = (("fit_loop.epoch_loop", "on_advance_end", True), ("fit_loop", "on_advance_end", True),
                ("fit_loop.epoch_loop.val_loop", "_evaluation_step", False))  # fmt: skip


class SigtermAgreement:
    """Installed on one trainer by :meth:`install`, on every rank; :meth:`close` at the normal end of training.
    ``group``: the gloo group the ranks agree on (``None``: one rank); ``checkpoint``: save ``on_sigterm.ckpt`` on
    an agreed stop; ``patches``: the run's, which undo what this sets on the trainer and the loaders."""

    def __init__(self, group: Any, patches: Patches, checkpoint: bool = True) -> None:
        self.group = group
        self.checkpoint = bool(checkpoint)
        self.noted = False
        self._agreement = Agreement(group)
        self._patches = patches
        self._stopping = False
        self._pid = os.getpid()

    def install(self, trainer: Any) -> Decision:
        """Take over ``trainer``'s per-batch check, its SIGTERM notifier and its stops on one rank; before its
        signal handlers are registered (``Strategy.setup`` is)."""
        self._trainer = trainer
        loop, connector = trainer.fit_loop.epoch_loop, trainer._signal_connector
        self._patches.set(loop, "_broadcast_sigterm_tensor", self.check)
        self._patches.set(connector, "_sigterm_notifier_fn", self.note)
        for path, name, here in _LOCAL_STOPS:
            owner = functools.reduce(getattr, path.split("."), trainer)
            self._patches.set(owner, name, self._deferred(getattr(owner, name), stop_here=here and self.group is None))
        if self.group is None:
            return Decision("sigterm_check", "one rank", "the rank stops after the batch the signal came in")
        return Decision(
            "sigterm_check",
            "any rank, asynchronous",
            "a MAX all-reduce of every rank's SIGTERM note on a gloo group, read one batch later: no per-step "
            "sync, and every rank stops at the same batch (Lightning's stops on the signalled rank alone wait "
            "for it)",
        )

    def checkpoint_decision(self) -> Decision:
        """Where an agreed stop saves, for the run summary (after :meth:`install`)."""
        if not self.checkpoint:
            return Decision("sigterm_checkpoint", False, "sigterm_checkpoint=False: the stop saves nothing")
        if (directory := checkpoint_dir(self._trainer)) is None:
            return Decision("sigterm_checkpoint", False, "no checkpoint callback with a directory: no save")
        return Decision(
            "sigterm_checkpoint",
            os.path.join(directory, CHECKPOINT_NAME),
            "on a SIGTERM every rank stops at the same batch and saves there, together; resume=auto and "
            "fit(ckpt_path='auto') pick it up (SoloDDP(sigterm_checkpoint=False): stop without saving, as stock)",
        )

    def note(self, signum: int, frame: Any) -> None:
        """The signal handler: no collective here, the next batches agree."""
        if os.getpid() != self._pid:
            return  # a process forked from this rank runs a copy of the handler: the signal is the rank's to act on
        log.info(f"[rank {dist.get_rank() if dist.is_initialized() else 0}] Received SIGTERM: {signum}")
        launcher = self._trainer.strategy.launcher
        if not self.noted and launcher is not None:
            launcher.kill(signum)  # as Lightning's handler: the popen launcher's children get it too
        self.noted = True
        self._trainer._signal_connector.received_sigterm = True  # as Lightning's handler: at once

    def check(self) -> None:
        """At each training batch, on every rank: start this batch's agreement, act on the last one's (Lightning
        calls it with more than one rank only)."""
        if self._agreement.check(self.noted):
            self._stop()

    def _stop(self) -> None:
        """Every rank is here, at the same batch boundary: save together, then stop."""
        self.close()  # sets trainer.received_sigterm on every rank: Lightning's own later checks agree
        self._stopping = True
        if self.checkpoint:
            self._save()
        raise SIGTERMException()

    def _save(self) -> None:
        trainer = self._trainer
        if (directory := checkpoint_dir(trainer)) is None:
            return
        path = os.path.join(directory, CHECKPOINT_NAME)
        solo_io = isinstance(trainer.strategy.checkpoint_io, SoloCheckpointIO)
        try:  # every rank; the strategy's barrier follows
            trainer.save_checkpoint(path, storage_options={"trigger": "sigterm"} if solo_io else None)
        except Exception:  # the stop goes on; the newest regular checkpoint remains
            log.exception("SIGTERM: saving %s failed", path)
            return
        rank_zero_info(f"SIGTERM: every rank stopped at global step {trainer.global_step}; saved {path}")

    def _deferred(self, method: Any, stop_here: bool) -> Any:
        """``method`` with Lightning's stop on this rank alone (``received_sigterm`` set by :meth:`note`) left to
        the agreement, or with ``stop_here`` made the agreed stop. The stop is the method's last statement, so
        nothing of it is skipped."""

        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except SIGTERMException:
                if not self.noted or self._stopping:
                    raise
                if stop_here:
                    self._stop()
                return None

        return run

    def shield_workers(self, dataloader: Any) -> Any:
        """Give ``dataloader``'s workers the signal handling of :func:`leave_signals_to_the_rank`, through its
        ``worker_init_fn``; its workers start with SIGTERM blocked (the thread that starts them blocks it
        meanwhile), so that no thread of theirs takes it before (a spawned worker has threads from its imports).
        Both until the run's patches close. Returns ``dataloader``."""
        if (
            isinstance(dataloader, DataLoader)
            and dataloader.num_workers > 0
            and not isinstance(dataloader.worker_init_fn, _ShieldedWorkerInit)
        ):
            self._patches.set(dataloader, "worker_init_fn", _ShieldedWorkerInit(dataloader.worker_init_fn))
            self._patches.set(dataloader, "_get_iterator", functools.partial(_start_blocked, dataloader._get_iterator))
        return dataloader

    def close(self) -> None:
        """Wait for the agreement in flight (every rank started it); only where every rank gets here. A SIGTERM too late
        for the batches to act on (the fit's last ones) lets the fit end, and ``trainer.received_sigterm`` says so."""
        if self._agreement.in_flight and (self._agreement.settle() or self.noted):
            self._trainer._signal_connector.received_sigterm = True


def _start_blocked(get_iterator: Any) -> Any:
    """``DataLoader._get_iterator`` (which starts the workers) with SIGTERM blocked in this thread meanwhile: the
    workers inherit the block. A SIGTERM to the rank then is taken by another thread, or when this one unblocks."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return get_iterator()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class _ShieldedWorkerInit:
    """A loader's ``worker_init_fn`` that first calls :func:`leave_signals_to_the_rank`, then the user's own; made
    in the rank, whose process id it carries. Picklable where the user's is (spawned workers)."""

    def __init__(self, user_fn: Any) -> None:
        self.user_fn = user_fn
        self.rank_pid = os.getpid()

    def __call__(self, worker_id: int) -> None:
        leave_signals_to_the_rank(self.rank_pid)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def leave_signals_to_the_rank(rank_pid: int) -> None:
    """In a loader worker: a SIGTERM from the worker's rank ends it quietly; one from anyone else is left to the
    rank, read by a thread of the worker's own (docs/sigterm.md, "Loader workers"). SLURM's requeue signals, whose
    inherited handlers are the rank's, are ignored."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started after this inherit the mask
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        if callable(signal.getsignal(signum)):
            signal.signal(signum, signal.SIG_IGN)

    def wait() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == rank_pid:
                os._exit(0)

    threading.Thread(target=wait, name="solo-worker-sigterm", daemon=True).start()


class SigtermSetting:
    """SoloDDP's ``sigterm_agreement`` and ``sigterm_checkpoint`` across its fits: each fit's
    :class:`SigtermAgreement` (``agreement``), or ``None`` where Lightning's own check stays."""

    def __init__(self, agreement: bool = True, checkpoint: bool = True) -> None:
        self.enabled = check_bool("sigterm_agreement", agreement)
        self.checkpoint = check_bool("sigterm_checkpoint", checkpoint)
        self.agreement: SigtermAgreement | None = None

    def install(
        self, trainer: Any, side_group: Callable[[], Any], decide: Callable[[Decision], Any], patches: Patches
    ) -> None:
        """A fit's setup, every rank alike, before Lightning registers its signal handlers: the agreement on the
        gloo group ``side_group()`` makes (asked for with several ranks only). Every decision goes to ``decide``."""
        if not self.enabled:
            decide(Decision("sigterm_check", "lightning", "sigterm_agreement=False: as stock"))
            return
        group = side_group() if trainer.world_size > 1 else None
        if trainer.world_size > 1 and group is None:
            decide(Decision("sigterm_check", "lightning", "no gloo group: Lightning's per-batch broadcast"))
            return
        self.agreement = SigtermAgreement(group, patches, checkpoint=self.checkpoint)
        decide(self.agreement.install(trainer))
        decide(self.agreement.checkpoint_decision())

    def shield_workers(self, dataloader: Any) -> Any:
        return self.agreement.shield_workers(dataloader) if self.agreement is not None else dataloader

    def close(self) -> None:
        if self.agreement is not None:
            self.agreement.close()

    def teardown(self) -> None:
        self.agreement = None  # the run's patches undo what it set
