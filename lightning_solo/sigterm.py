"""SIGTERM noticed on any rank stops every rank at the same batch, with no collective on the training stream.

Lightning 2.6 (``training_epoch_loop._broadcast_sigterm_tensor``, ``signal_connector._sigterm_notifier_fn``):

- every training batch broadcasts rank 0's SIGTERM flag as a device tensor and reads it back: on GPUs a host sync
  per step (Lightning #21487), on CPU a step every rank waits for;
- its signal handler broadcasts once more, from wherever the signal interrupted that rank: a collective the other
  ranks do not issue there, which pairs with another (hang, or wrong data);
- the rank that got the signal raises at the end of its batch on its own, and the others wait in their next
  collective until the timeout.

:class:`SigtermAgreement` replaces those two pieces of one trainer: the handler only notes the signal (and, as
Lightning's does, passes it to the launcher's child processes); at each training batch every rank starts an
asynchronous MAX all-reduce of its note on a gloo group (a CPU tensor) and reads the one started at the batch
before. Any rank's SIGTERM thus stops every rank, at the same batch, at most two batches after it arrived.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_solo.decision import Decision

log = logging.getLogger(__name__)


class SigtermAgreement:
    """Installed on one trainer by :meth:`install`, on every rank; :meth:`close` at the normal end of training,
    :meth:`uninstall` at teardown."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.noted = False
        self._pending: tuple[torch.Tensor, Any] | None = None

    def install(self, trainer: Any) -> Decision:
        """Take over ``trainer``'s per-batch check and its SIGTERM notifier; before its signal handlers are
        registered (``Strategy.setup`` is)."""
        self._trainer = trainer
        loop, connector = trainer.fit_loop.epoch_loop, trainer._signal_connector
        if not (hasattr(loop, "_broadcast_sigterm_tensor") and hasattr(connector, "_sigterm_notifier_fn")):
            return Decision("sigterm_check", "lightning", "this Lightning has no per-batch SIGTERM broadcast")
        loop._broadcast_sigterm_tensor = self.check  # instance attributes: this trainer only
        connector._sigterm_notifier_fn = self.note
        return Decision(
            "sigterm_check",
            "any rank, asynchronous",
            "a MAX all-reduce of every rank's SIGTERM note on a gloo group, read one batch later: no per-step "
            "sync, and every rank stops at the same batch",
        )

    def note(self, signum: int, frame: Any) -> None:
        """The signal handler: no collective here, the next batches agree."""
        log.info(f"[rank {dist.get_rank() if dist.is_initialized() else 0}] Received SIGTERM: {signum}")
        launcher = self._trainer.strategy.launcher
        if not self.noted and launcher is not None:
            launcher.kill(signum)  # as Lightning's handler: the popen launcher's children get it too
        self.noted = True

    def check(self) -> None:
        """At each training batch, on every rank: start this batch's agreement, act on the last one's."""
        flag = torch.tensor([float(self.noted)])
        previous = self._pending
        self._pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        if previous is not None:
            agreed, work = previous
            work.wait()
            if agreed.item() > 0:
                self.close()  # sets trainer.received_sigterm: Lightning's own later checks agree
                raise SIGTERMException()

    def uninstall(self) -> None:
        """Give the trainer Lightning's check and notifier back (a later ``validate`` on it uses them)."""
        for owner, name in ((self._trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor"),
                            (self._trainer._signal_connector, "_sigterm_notifier_fn")):  # fmt: skip
            vars(owner).pop(name, None)

    def close(self) -> None:
        """Wait for the agreement in flight (every rank started it); only where every rank gets here. A SIGTERM too
        late for the batches to act on (the fit's last ones) lets the fit end, and ``trainer.received_sigterm``
        says so."""
        if self._pending is not None:
            agreed, work = self._pending
            work.wait()
            self._pending = None
            if agreed.item() > 0 or self.noted:
                self._trainer._signal_connector.received_sigterm = True
