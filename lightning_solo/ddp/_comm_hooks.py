"""SoloDDP's gradient-communication hooks: the comm hook registered on every device, post-local-SGD's averager
(in place, its step restored on resume), its local steps outside DDP's reducer and the final average, and
``comm_hook="auto"``'s step timing.

The hooks themselves (fp16, bf16, PowerSGD, post-local-SGD, "auto") are :mod:`lightning_solo.ddp.comm`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.core.decision import Decision
from lightning_solo.ddp._base import SoloStrategyBase


class GradientCommHooks(SoloStrategyBase):
    """The gradient-communication hooks of :class:`~lightning_solo.ddp.strategy.SoloDDP` (not used on its own)."""

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only (a torch 1.8 limit, long gone): register on every device.
        if self._comm.name is None and self._ddp_comm_hook is not None:
            lightning_compat.register_ddp_comm_hook(  # self.model is DDP here
                self.model,
                self._ddp_comm_state,
                self._ddp_comm_hook,
                self._ddp_comm_wrapper,  # type: ignore[arg-type]
            )
            name = getattr(self._ddp_comm_hook, "__qualname__", repr(self._ddp_comm_hook))
            self._decide(Decision("comm_hook", name, "ddp_comm_hook given by the user"))
            return
        self._decide(self._comm.register(self.model, node=self.node_rank))  # type: ignore[arg-type]
        if self._comm.averaging_period is not None:
            # DDPStrategy.setup starts its PeriodicModelAverager when it sees a PostLocalSGDState.
            self._ddp_comm_state = self._comm.state
            self._model_averaging_period = self._comm.averaging_period

    _own_replica_restored: bool = False  # set by ExactResumeHooks.load_checkpoint

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        if not self._own_replica_restored:
            return super()._setup_model(model)
        # Each rank resumed its own post-local-SGD replica: DDP must not broadcast rank 0's over it.
        self._own_replica_restored = False
        kwargs, self._ddp_kwargs = self._ddp_kwargs, {**self._ddp_kwargs, "init_sync": False}
        try:
            return super()._setup_model(model)
        finally:
            self._ddp_kwargs = kwargs

    @override
    def _enable_model_averaging(self) -> None:
        super()._enable_model_averaging()
        # Same schedule, averaging in place (keeps channels_last); restores its step count on resume.
        self._model_averager = self._comm.attach_averager(self._model_averager)  # type: ignore[arg-type]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._comm.local_step and isinstance(self.model, DistributedDataParallel):
            # Post-local-SGD's local steps skip DDP's reducer, as no_sync does (see CommHook.local_step). Only
            # ever set False: Lightning's accumulation restores the flag it found when its no_sync ends.
            self.model.require_backward_grad_sync = False
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # Strategy's step without DDPStrategy's: its post-local-SGD average takes only the parameters that have a
        # gradient, and after a local step a parameter one rank did not use has none there, so the ranks would
        # average different tensors. CommHook.average_after_step takes every trainable one instead.
        output = super(DDPStrategy, self).optimizer_step(optimizer, closure, model, **kwargs)
        if self._model_averager is not None:
            self._comm.average_after_step(optimizer)
        if self._comm.local_step and isinstance(self.model, DistributedDataParallel):
            # As after a synchronised step, the next forward (training or validation) broadcasts rank 0's buffers
            # (BatchNorm statistics); a forward outside the reducer would otherwise have switched that off.
            self.model.require_forward_param_sync = True
        self._comm.after_step(self.root_device)  # comm_hook="auto" times its trials
        return output

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._model_averager is not None:
            # Post-local-SGD: between averages the ranks' models differ; end on their average, not rank 0's.
            self._comm.average_parameters(self.module)
