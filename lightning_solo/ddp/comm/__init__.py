"""Gradient communication for DDP: comm hooks by name or "auto", and the monitored barrier with its gloo side
group. See docs/comm-hooks.md and docs/ranks.md."""

from lightning_solo.ddp.comm.auto import make_comm_hook
from lightning_solo.ddp.comm.barrier import SideGroups, monitored_barrier
from lightning_solo.ddp.comm.hooks import CHECKPOINT_KEY, CommHook

__all__ = ["CHECKPOINT_KEY", "CommHook", "SideGroups", "make_comm_hook", "monitored_barrier"]
