"""SlurmRequeue: on SLURM's time-limit signal, save a verified checkpoint and requeue the job, whichever handler
owns the signal. See docs/sigterm.md."""

from __future__ import annotations

import logging
import os
import signal as signals
import subprocess
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.callbacks.solo_checkpoint import SoloCheckpoint
from lightning_solo.checkpoint.io import SoloCheckpointIO
from lightning_solo.core import cluster
from lightning_solo.core.checks import check_int
from lightning_solo.core.decision import Decision, DecisionLog
from lightning_solo.ddp.agreement import Agreement
from lightning_solo.ddp.strategy import SoloDDP

log = logging.getLogger(__name__)


def requeue_signal(environment: Any, given: str | int | None = None) -> signals.Signals:
    """The signal to watch: ``given`` (a name such as ``"SIGUSR1"``/``"USR1"``, or a number); else submitit's
    (``SUBMITIT_PREEMPT_SIGNAL``, default USR2) inside a submitit job; else the SLURM environment's
    ``requeue_signal`` (SIGUSR1 by default)."""
    if given is not None:
        if isinstance(given, str):
            return signals.Signals[given if given.startswith("SIG") else "SIG" + given]
        return signals.Signals(given)
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        return signals.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")]
    return getattr(environment, "requeue_signal", None) or signals.SIGUSR1


class SlurmRequeue(DecisionLog, L.Callback):
    """Save a verified checkpoint and requeue on SLURM's signal; a no-op off SLURM (arguments: docs/sigterm.md)."""

    def __init__(self, signal: str | int | None = None, check_every_n_steps: int = 1) -> None:
        self.signal = signal
        self.check_every_n_steps = check_int("check_every_n_steps", check_every_n_steps)
        self.decisions: dict[str, Decision] = {}
        self.checkpoint_path: str | None = None
        self._signum: signals.Signals | None = None
        self._previous: Any = None
        self._received = False
        self._agreement: Agreement | None = None  # None: agree synchronously (no gloo group at hand)
        self._pid = os.getpid()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After Lightning registered its own handlers (Trainer._run), so we see who owns the signal.
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if not isinstance(environment, SLURMEnvironment):
            return  # not a SLURM job: nothing to watch
        signum = requeue_signal(environment, self.signal)
        if lightning_compat.lightning_owns_requeue_signal(trainer, signum):
            why = f"Lightning's handler owns {signum.name}: hpc_ckpt + scontrol"
            self._decide(Decision("requeue", "lightning", why))
            return
        previous = signals.getsignal(signum)
        self._signum, self._previous, self._received = signum, previous, False
        self._agreement = _agreement(trainer)
        self._pid = os.getpid()
        signals.signal(signum, self._flag)
        owner = getattr(previous, "__qualname__", None) if callable(previous) else None
        then = f"then {owner}" if owner else "then scontrol requeue"
        self._decide(Decision("requeue", "solo", f"{signum.name}: verified hpc_ckpt at the next batch end, {then}"))

    def _flag(self, signum: int, frame: Any) -> None:
        # Only a flag: a collective here would pair with whatever collective another rank is inside. SLURM signals
        # every process of the step: a process forked from the rank (a loader worker) runs a copy, which is not it.
        if os.getpid() == self._pid:
            self._received = True

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._signum is None or trainer.global_step % self.check_every_n_steps:
            return
        if not self._any_rank(trainer):
            return
        path = trainer.strategy.broadcast(lightning_compat.hpc_save_path(trainer), src=0)
        note = {"trigger": "requeue", "signal": self._signum.name}
        options = note if isinstance(trainer.strategy.checkpoint_io, SoloCheckpointIO) else None
        trainer.save_checkpoint(path, storage_options=options)  # every rank; the strategy's barrier follows
        self.checkpoint_path = path
        rank_zero_info(f"SlurmRequeue: {self._signum.name}: saved {path}; requeueing")
        trainer.should_stop = True
        for callback in trainer.checkpoint_callbacks:  # a background write in flight commits before the requeue
            if isinstance(callback, SoloCheckpoint):
                callback.wait_for_write("SLURM requeue")
        if trainer.is_global_zero:
            self._requeue(trainer)

    def _requeue(self, trainer: L.Trainer) -> None:
        previous, signum = self._previous, self._signum
        self._restore()
        if callable(previous):  # submitit's handler: it requeues the job (scontrol) and exits
            previous(signum, None)
            return
        job = cluster.slurm_job_id()
        result = subprocess.call(["scontrol", "requeue", job])
        (log.info if result == 0 else log.warning)("scontrol requeue %s: exit status %s", job, result)

    def _any_rank(self, trainer: L.Trainer) -> bool:
        if self._agreement is not None:
            return self._agreement.check(self._received)
        return bool(trainer.strategy.reduce_boolean_decision(self._received, all=False))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._agreement is not None:
            self._agreement.settle()  # every rank ends here: the check in flight (too late to act on)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._agreement = None
        self._restore()

    def _restore(self) -> None:
        if self._signum is not None:
            signals.signal(self._signum, self._previous if self._previous is not None else signals.SIG_DFL)
            self._signum = None


def _agreement(trainer: L.Trainer) -> Agreement | None:
    """Where the ranks agree: none to agree with (one rank), SoloDDP's gloo side group, or the world when it runs
    gloo; ``None`` where no gloo group is at hand (NCCL under another strategy)."""
    if trainer.world_size == 1 or not dist.is_initialized():
        return Agreement(None)
    if isinstance(trainer.strategy, SoloDDP) and trainer.strategy.side_group is not None:
        return Agreement(trainer.strategy.side_group)
    return Agreement(dist.group.WORLD) if dist.get_backend() == "gloo" else None
