"""Synchronised BatchNorm for any process-group backend (gloo on CPU, nccl on GPU).

``torch.nn.SyncBatchNorm`` refuses CPU tensors and DDP refuses to wrap it on CPU, and Lightning's
``sync_batchnorm=True`` reverts layers to a generic ``_BatchNormXd`` after fit. This module gives:

* :class:`SoloSyncBatchNorm`: statistics all-reduced over the global batch in forward (one all-reduce
  of ``2C + 1`` float64 values), exact gradients in backward (one all-reduce of ``2C`` values), running
  statistics identical to BatchNorm over the concatenated batch, uneven or empty per-rank batches weighted by
  their element counts, no communication in eval mode. The same code on CPU and CUDA (torch's SyncBN kernels
  there): no host sync, no copy of fp16/bf16 activations, the input gradient computed in fp32 and rounded once,
  same collectives on every rank whatever its autocast dtype. :func:`sync_batch_norm` is its functional form.
* :func:`convert` / :func:`revert`: synchronise a model's BatchNorm layers in place and give them back their
  *original* classes (same objects, same state-dict keys, so checkpoints stay torchvision-compatible). A
  converted layer stays an instance of its class, whose ``forward`` still runs: SoloSyncBatchNorm's sits beneath
  it. :func:`left_alone` names the layers whose own ``forward`` would never reach it; they stay as they are.
* :func:`decide`: the ``sync_batchnorm="auto"`` policy, returning a :class:`Decision`
  (:mod:`~lightning_solo.ddp.syncbn.policy`; the layer and the swap are :mod:`~lightning_solo.ddp.syncbn.layer`).

Example::

    import torch, torchvision
    from lightning_solo.ddp import syncbn

    # in each rank, after torch.distributed.init_process_group("gloo" or "nccl")
    model = syncbn.convert(torchvision.models.resnet18(num_classes=10))   # in place
    ddp = torch.nn.parallel.DistributedDataParallel(model)                # works on CPU + gloo
    ...                                                                   # train
    syncbn.revert(model)                                                  # BatchNorm2d again

With SoloDDP none of this is needed: ``SoloDDP(sync_batchnorm="auto")`` converts before the DDP wrap
(on NCCL with a process group of SyncBN's own, so that its collectives never wait behind DDP's buckets) and
reverts at teardown; see :func:`decide_layer_sync`. Converting by hand, pass
``process_group=torch.distributed.new_group(backend="nccl")`` to :func:`convert` for the same.
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
