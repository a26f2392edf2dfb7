"""SoloDDP's gradient-communication hooks: the comm hook registered on every device, post-local-SGD's averager
(in place, its step restored on resume) and the final average, and ``comm_hook="auto"``'s step timing.

The hooks themselves (fp16, bf16, PowerSGD, post-local-SGD, "auto") are :mod:`lightning_solo.comm`.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.decision import Decision
from lightning_solo.strategy.base import SoloStrategyBase


class GradientCommHooks(SoloStrategyBase):
    """The gradient-communication hooks of :class:`~lightning_solo.strategy.SoloDDP` (not used on its own)."""

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

    @override
    def _enable_model_averaging(self) -> None:
        super()._enable_model_averaging()
        # Same schedule, averaging in place (keeps channels_last); restores its step count on resume.
        self._model_averager = self._comm.attach_averager(self._model_averager)  # type: ignore[arg-type]

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)  # the resume point is taken there (resume_hooks)
        self._comm.after_step(self.root_device)  # comm_hook="auto" times its trials
        return output

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._model_averager is not None:
            # Post-local-SGD: between averages the ranks' models differ; end on their average, not rank 0's.
            self._comm.average_parameters(self.module)
