"""The ``sync_batchnorm="auto"`` policy (:func:`decide`), SoloDDP's SyncBN step for one fit
(:func:`decide_layer_sync`) and the group SyncBN's collectives use there (:func:`sync_group`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from torch import nn
from typing_extensions import override

from lightning_solo._compat.torch import BatchNormBase
from lightning_solo.core.batch_size import per_device_batch_size
from lightning_solo.core.checks import check_choice, check_int
from lightning_solo.core.decision import Decision
from lightning_solo.ddp.comm.barrier import backend_for, group_per_world
from lightning_solo.ddp.syncbn.layer import _ORIGINAL_CLS, _SYNC_CLASSES, convert, left_alone, revert

if TYPE_CHECKING:
    import lightning.pytorch as pl

SyncOption = bool | Literal["auto"]
_OPTIONS = (True, False, "auto")
_NAMED = 4  # layers left alone named in the decision; the others counted


def validate(option: Any, threshold: Any) -> None:
    """Fail at construction, not at setup, on a bad ``sync_batchnorm`` or threshold."""
    check_choice("sync_batchnorm", option, _OPTIONS)
    check_int("sync_batchnorm_threshold", threshold)  # a per-device batch size


def decide(
    option: SyncOption,
    *,
    has_batchnorm: bool,
    world_size: int,
    per_device_batch: int | None,
    threshold: int = 32,
    trainer_flag: bool = False,
    left_alone: Sequence[str] = (),
) -> Decision:
    """Whether to synchronise BatchNorm: "auto" with BatchNorm, several processes and a per-device batch below
    ``threshold``. ``trainer_flag``: ``Trainer(sync_batchnorm=True)``; ``left_alone``: layers SyncBN cannot take."""
    decision = _decide(option, has_batchnorm or bool(left_alone), world_size, per_device_batch, threshold,
                       trainer_flag)  # fmt: skip
    if not (decision.value and left_alone):
        return decision
    more = f" and {len(left_alone) - _NAMED} more" if len(left_alone) > _NAMED else ""
    alone = f"left alone, as under DDP: {', '.join(left_alone[:_NAMED])}{more}"
    if not has_batchnorm:
        return Decision("sync_batchnorm", False, f"no BatchNorm layer can be synchronised; {alone}")
    return Decision("sync_batchnorm", True, f"{decision.reason}; {alone}")


def _decide(
    option: SyncOption,
    has_batchnorm: bool,
    world_size: int,
    per_device_batch: int | None,
    threshold: int,
    trainer_flag: bool,
) -> Decision:
    validate(option, threshold)
    if trainer_flag:
        if option is False:
            raise ValueError(
                "Trainer(sync_batchnorm=True) contradicts SoloDDP(sync_batchnorm=False); "
                "set one of them, accepted values for SoloDDP are (True, False, 'auto')"
            )
        option = True
    source = "Trainer(sync_batchnorm=True)" if trainer_flag else "set by the user"
    if option is False:
        return Decision("sync_batchnorm", False, "set by the user")
    if not has_batchnorm:
        return Decision("sync_batchnorm", False, "the model has no BatchNorm layers")
    if option is True:
        return Decision("sync_batchnorm", True, source)
    if world_size <= 1:
        return Decision("sync_batchnorm", False, "a single process: there is nothing to synchronise")
    if per_device_batch is None:
        return Decision(
            "sync_batchnorm", False, "per-device batch size unknown; pass sync_batchnorm=True to synchronise"
        )
    if per_device_batch >= threshold:
        return Decision(
            "sync_batchnorm", False, f"per-device batch {per_device_batch} >= {threshold}: local statistics suffice"
        )
    why = f"per-device batch {per_device_batch} < {threshold}: per-device statistics would be noisy"
    return Decision(
        "sync_batchnorm", True, f"{why}; statistics over the global batch of {per_device_batch * world_size}"
    )


def sync_group(timeout: timedelta | None = None) -> Any:
    """SoloSyncBatchNorm's group in a SoloDDP fit: on NCCL its own (high-priority stream), else the world."""
    if not _nccl_world():
        return None

    def make() -> Any:
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        return dist.new_group(backend="nccl", timeout=timeout, pg_options=options, group_desc="syncbn")

    return group_per_world("syncbn", make)


def _nccl_world() -> bool:
    """A live default group of several ranks whose CUDA tensors go through NCCL."""
    live = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return live and backend_for(dist.get_backend(), "cuda") == "nccl"


class _SoloLayerSync(LayerSync):
    """What SoloDDP hands to DDPStrategy.setup/teardown in place of Lightning's CUDA-only plugin."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        self.timeout = timeout

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        convert(model)
        group = sync_group(self.timeout)
        # Layers that were plain BatchNorm get the group; a SyncBatchNorm of the user's keeps its own.
        for module in model.modules():
            original = getattr(module, _ORIGINAL_CLS, None)
            if original is not None and not issubclass(original, _SYNC_CLASSES):
                module.process_group = group
        return model

    @override
    def revert(self, model: nn.Module) -> nn.Module:
        return revert(model)


def decide_layer_sync(
    trainer: pl.Trainer, option: SyncOption, threshold: int, requested: LayerSync | None
) -> tuple[Decision, LayerSync | None]:
    """SoloDDP's SyncBN step for one fit: the decision and the plugin DDPStrategy applies (or ``None``).
    ``requested``: the connector's plugin (Lightning's, replaced by ours; a custom one, kept)."""
    if requested is not None and not isinstance(requested, (TorchSyncBatchNorm, _SoloLayerSync)):
        return Decision(
            "sync_batchnorm", type(requested).__name__, "a LayerSync plugin given to the Trainer"
        ), requested
    model, trainer_flag = trainer.lightning_module, isinstance(requested, TorchSyncBatchNorm)
    alone = left_alone(model) if option is not False or trainer_flag else []  # off: no class is made
    decision = decide(
        option,
        has_batchnorm=sum(isinstance(m, BatchNormBase) for m in model.modules()) > len(alone),
        world_size=trainer.world_size,
        per_device_batch=per_device_batch_size(trainer),
        threshold=threshold,
        trainer_flag=trainer_flag,
        left_alone=alone,
    )
    if not decision.value:
        return decision, None
    timeout = getattr(trainer.strategy, "collective_timeout", None)
    group = "its own NCCL group" if _nccl_world() else "the world group"
    return Decision(decision.setting, True, f"{decision.reason}; SoloSyncBatchNorm on {group}"), _SoloLayerSync(timeout)


class LayerSyncChoice:
    """Lightning's ``_layer_sync`` across a strategy's fits: the plugin chosen for each fit, the request put back."""

    def __init__(self, option: SyncOption, threshold: int) -> None:
        validate(option, threshold)
        self.option, self.threshold = option, threshold
        self._request: Any = None
        self._read = False

    def choose(self, strategy: Any, trainer: pl.Trainer) -> Decision:
        if not self._read:
            self._request, self._read = strategy._layer_sync, True
        decision, strategy._layer_sync = decide_layer_sync(trainer, self.option, self.threshold, self._request)
        return decision

    @contextlib.contextmanager
    def around_teardown(self, strategy: Any) -> Iterator[None]:
        if not self._read:  # no fit's setup chose a plugin: nothing to revert
            self._request, strategy._layer_sync = strategy._layer_sync, None
        yield
        strategy._layer_sync, self._read = self._request, False  # the request, as found
