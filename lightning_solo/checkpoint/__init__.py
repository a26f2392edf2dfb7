"""Checkpoint files: atomic, verified writes and loads (``io``, ``manifest``), the newest valid one (``select``),
sharded directories (``sharded``), per-rank files beside a checkpoint (``rank_shards``), background writes
(``background``). See docs/checkpoints.md."""

from lightning_solo.checkpoint.io import (
    SoloCheckpointIO,
    UnsafeCheckpointError,
    clean_stale_temp_files,
    load_weights_only,
)
from lightning_solo.checkpoint.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    CheckpointVerificationError,
    read_manifest,
    verify,
)
from lightning_solo.checkpoint.select import (
    checkpoint_dir,
    decide_resume,
    find_latest_valid,
    hpc_checkpoints,
    resolve_ckpt_path,
)

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "CheckpointVerificationError",
    "SoloCheckpointIO",
    "UnsafeCheckpointError",
    "checkpoint_dir",
    "clean_stale_temp_files",
    "decide_resume",
    "find_latest_valid",
    "hpc_checkpoints",
    "load_weights_only",
    "read_manifest",
    "resolve_ckpt_path",
    "verify",
]
