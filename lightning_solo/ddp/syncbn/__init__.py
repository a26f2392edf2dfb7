"""Synchronised BatchNorm for any backend: :class:`SoloSyncBatchNorm`, :func:`convert` / :func:`revert` and the
``sync_batchnorm="auto"`` policy (:func:`decide`). See docs/syncbn.md."""

from lightning_solo.ddp.syncbn.layer import SoloSyncBatchNorm, convert, left_alone, revert, sync_batch_norm
from lightning_solo.ddp.syncbn.policy import LayerSyncChoice, SyncOption, decide, decide_layer_sync, validate

__all__ = [
    "LayerSyncChoice",
    "SoloSyncBatchNorm",
    "SyncOption",
    "convert",
    "decide",
    "decide_layer_sync",
    "left_alone",
    "revert",
    "sync_batch_norm",
    "validate",
]
