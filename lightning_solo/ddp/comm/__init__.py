"""Gradient communication for DDP: comm hooks by name (``hooks``), ``comm_hook="auto"`` (``auto``), PowerSGD's
state across re-bucketing and resume (``powersgd_state``), post-local-SGD's averaging (``averaging``) and the
monitored barrier with its gloo side group (``barrier``). Exported here: what SoloDDP and users need."""

from lightning_solo.ddp.comm.auto import make_comm_hook
from lightning_solo.ddp.comm.barrier import SideGroups, monitored_barrier
from lightning_solo.ddp.comm.hooks import CHECKPOINT_KEY, CommHook

__all__ = ["CHECKPOINT_KEY", "CommHook", "SideGroups", "make_comm_hook", "monitored_barrier"]
