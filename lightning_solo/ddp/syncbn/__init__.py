"""Synchronised BatchNorm for any process-group backend (gloo on CPU, nccl on GPU): :class:`SoloSyncBatchNorm`,
:func:`sync_batch_norm`, :func:`convert` / :func:`revert` (in place, original classes back), and the
``sync_batchnorm="auto"`` policy (:func:`decide`). See docs/syncbn.md.

Example::

    model = syncbn.convert(torchvision.models.resnet18(num_classes=10))   # in each rank, in place
    ddp = torch.nn.parallel.DistributedDataParallel(model)                # works on CPU + gloo
    syncbn.revert(model)                                                  # BatchNorm2d again
"""

from lightning_solo.ddp.syncbn.layer import (
    SoloSyncBatchNorm,
    convert,
    has_batchnorm,
    left_alone,
    revert,
    sync_batch_norm,
)
from lightning_solo.ddp.syncbn.policy import LayerSyncChoice, SyncOption, decide, decide_layer_sync, validate

__all__ = [
    "LayerSyncChoice",
    "SoloSyncBatchNorm",
    "SyncOption",
    "convert",
    "decide",
    "decide_layer_sync",
    "has_batchnorm",
    "left_alone",
    "revert",
    "sync_batch_norm",
    "validate",
]
