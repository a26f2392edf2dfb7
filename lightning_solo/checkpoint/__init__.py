"""Checkpoint files: atomic, verified writes and loads (``io``, ``manifest``), the newest valid one
(``select``), sharded directories (``sharded``) and per-rank files beside a checkpoint (``rank_shards``); the
map of the package is docs/design.md; the files, resume and exact resume: docs/checkpoints.md.

Example::

    import lightning as L
    from lightning_solo import SoloDDP
    from lightning_solo.checkpoint import SoloCheckpointIO, resolve_ckpt_path, verify

    trainer = L.Trainer(strategy=SoloDDP())          # SoloCheckpointIO is SoloDDP's default
    trainer.fit(model, ckpt_path=resolve_ckpt_path("auto", "outputs/checkpoints"))
    verify("outputs/checkpoints/last.ckpt")          # -> the manifest, or CheckpointVerificationError
"""

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
