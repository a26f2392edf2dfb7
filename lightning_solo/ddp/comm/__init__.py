"""Gradient communication for DDP, in six parts:

- :mod:`~lightning_solo.ddp.comm.hooks`: :class:`CommHook`, a DDP comm hook chosen by name (exact, fp16/bf16,
  PowerSGD, post-local-SGD), registered on every backend, with checkpointable state;
- :mod:`~lightning_solo.ddp.comm.powersgd_state`: PowerSGD's state across bucket rebuilds and checkpoint/resume
  (error feedback as one shard file per rank beside the checkpoint);
- :mod:`~lightning_solo.checkpoint.rank_shards`: state that differs per rank (PowerSGD's error feedback, post-local-SGD's
  replicas between averages) as one verified file per rank beside the checkpoint;
- :mod:`~lightning_solo.ddp.comm.averaging`: post-local-SGD's in-place parameter averaging and per-node groups;
- :mod:`~lightning_solo.ddp.comm.barrier`: a barrier that names the ranks that did not arrive, and its gloo side
  group under NCCL;
- :mod:`~lightning_solo.ddp.comm.auto`: ``comm_hook="auto"``, each candidate hook measured for a few steps, the
  fastest kept (:class:`AutoCommHook`, :func:`decide_comm_hook`).

The public names are re-exported here, so ``from lightning_solo.ddp.comm import CommHook`` keeps working.
"""

from lightning_solo.checkpoint.rank_shards import shard_dir
from lightning_solo.ddp.comm.auto import AUTO_CANDIDATES, AutoCommHook, decide_comm_hook, make_comm_hook
from lightning_solo.ddp.comm.averaging import InPlaceAverager, average_in_place, node_groups
from lightning_solo.ddp.comm.barrier import SIDE_GROUP_TIMEOUT, backend_for, barrier_group, monitored_barrier
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
