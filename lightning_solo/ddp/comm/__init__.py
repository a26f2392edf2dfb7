"""Gradient communication for DDP: comm hooks by name on every backend (``hooks``), ``comm_hook="auto"``
(``auto``), PowerSGD's state across re-bucketing and resume (``powersgd_state``), post-local-SGD's in-place
averaging (``averaging``) and the monitored barrier with its gloo side group (``barrier``). The map of the
package is docs/design.md; the public names are re-exported here."""

from lightning_solo.checkpoint.rank_shards import shard_dir
from lightning_solo.ddp.comm.auto import AUTO_CANDIDATES, AutoCommHook, decide_comm_hook, make_comm_hook
from lightning_solo.ddp.comm.averaging import InPlaceAverager, average_in_place, node_groups
from lightning_solo.ddp.comm.barrier import (
    SIDE_GROUP_TIMEOUT,
    SideGroups,
    backend_for,
    barrier_group,
    monitored_barrier,
)
from lightning_solo.ddp.comm.hooks import (
    CHECKPOINT_KEY,
    COMM_HOOKS,
    CommHook,
    bf16_compress_any_build_hook,
    check_bucket_cap_mb,
)
from lightning_solo.ddp.comm.powersgd_state import resumable_powerSGD_hook

__all__ = [
    "AUTO_CANDIDATES",
    "CHECKPOINT_KEY",
    "COMM_HOOKS",
    "SIDE_GROUP_TIMEOUT",
    "AutoCommHook",
    "CommHook",
    "InPlaceAverager",
    "SideGroups",
    "average_in_place",
    "backend_for",
    "barrier_group",
    "bf16_compress_any_build_hook",
    "check_bucket_cap_mb",
    "decide_comm_hook",
    "make_comm_hook",
    "monitored_barrier",
    "node_groups",
    "resumable_powerSGD_hook",
    "shard_dir",
]
