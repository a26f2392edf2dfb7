"""Any rank flagged, all stop: the one agreement behind the stops a signal asks for on some ranks only (SIGTERM in
:mod:`lightning_solo.ddp.sigterm`, SLURM's requeue signal in :mod:`lightning_solo.callbacks.requeue`).

A signal handler may only note the signal: a collective issued from it would pair with whatever collective another
rank is inside. So at each check, which every rank makes at the same point of training (a batch), every rank starts
an asynchronous MAX all-reduce of its note on a gloo group (a CPU tensor: no host sync, nothing on the training
stream) and reads the one it started at the check before. Every rank thus learns "some rank was flagged" at the
same check, one check after the flag was raised, and they act together.

Example::

    agreement = Agreement(group)        # a gloo group of every rank; None: one rank, nothing to agree
    if agreement.check(flagged):        # at each batch, on every rank alike
        ...                             # every rank is here, at the same batch: stop together
    agreement.settle()                  # where every rank ends normally: the check still in flight
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Agreement:
    """Whether any rank raised its flag, agreed asynchronously one check later (see the module docstring).

    Args:
        group: the gloo group of every rank the checks run on; ``None``: one rank, whose own flag is the answer.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self._pending: tuple[torch.Tensor, Any] | None = None

    @property
    def in_flight(self) -> bool:
        """A check's all-reduce was started and not yet read."""
        return self._pending is not None

    def check(self, flagged: bool) -> bool:
        """Start this check's all-reduce of ``flagged`` and read the one started at the previous check: True when
        some rank was flagged then. Call on every rank at the same points; with no group: ``flagged``."""
        if self.group is None:
            return flagged
        flag = torch.tensor([float(flagged)])
        previous = self._pending
        self._pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        return previous is not None and _read(previous)

    def settle(self) -> bool:
        """Wait for the check in flight, if any, and whether it found a rank flagged; only where every rank gets
        here (every rank started it)."""
        pending, self._pending = self._pending, None
        return pending is not None and _read(pending)


def _read(pending: tuple[torch.Tensor, Any]) -> bool:
    agreed, work = pending
    work.wait()
    return agreed.item() > 0
