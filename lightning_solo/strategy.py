"""SoloDDP: Lightning's DDPStrategy with defaults that are right for 1..N devices.

Example::

    import lightning as L
    from lightning_solo import SoloDDP

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SoloDDP())   # or strategy="solo_ddp"
    trainer.fit(model, datamodule)
    print(trainer.strategy.decisions)        # what SoloDDP chose on your behalf, and why

This module is wiring only: each decision is made by a function in its own module and recorded as a
:class:`~lightning_solo.decision.Decision` in ``self.decisions`` for the run summary.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_solo.decision import Decision

StartMethod = Literal["auto", "popen", "spawn", "fork", "forkserver"]
_START_METHODS = ("auto", "popen", "spawn", "fork", "forkserver")


def in_notebook() -> bool:
    """True inside IPython/Jupyter (or ``python -i``), where only a fork launcher can work."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "IPython" in sys.modules and _ipython_active()


def _ipython_active() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def resolve_start_method(start_method: str) -> Decision:
    """``"auto"`` means fork inside a notebook (spawn and popen cannot work there) and popen elsewhere."""
    if start_method not in _START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not one of {_START_METHODS}")
    if start_method != "auto":
        return Decision("start_method", start_method, "set by the user")
    if in_notebook():
        return Decision("start_method", "fork", "interactive session: only a fork launcher works here")
    return Decision("start_method", "popen", "script: each rank re-runs the command (Lightning's default)")


class SoloDDP(DDPStrategy):
    """DDP with sound defaults: ``gradient_as_bucket_view=True``, a launcher chosen by context,
    nccl on CUDA and gloo on CPU.

    Args:
        gradient_as_bucket_view: let gradients alias DDP's buckets (saves one copy of the gradients).
        start_method: ``"auto"`` (fork in notebooks, popen in scripts), or one of Lightning's launchers.
        timeout: collective timeout, a ``timedelta`` or seconds.
        **ddp_kwargs: passed to :class:`torch.nn.parallel.DistributedDataParallel` (``bucket_cap_mb``,
            ``static_graph``, ``broadcast_buffers``, ...).
    """

    strategy_name = "solo_ddp"

    def __init__(
        self,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        *,
        gradient_as_bucket_view: bool = True,
        start_method: StartMethod = "auto",
        timeout: timedelta | float | int = timedelta(minutes=30),
        process_group_backend: str | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        launcher = resolve_start_method(start_method)
        if not isinstance(timeout, timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
            timeout = timedelta(seconds=timeout)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=launcher.value,
            gradient_as_bucket_view=gradient_as_bucket_view,
            **ddp_kwargs,
        )
        self.decisions: dict[str, Decision] = {}
        self._decide(launcher)

    def _decide(self, decision: Decision) -> Decision:
        self.decisions[decision.setting] = decision
        return decision

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        # Only our own names: the inherited method would re-register "ddp" and raise.
        for name, start_method, description in (
            ("solo_ddp", "auto", "SoloDDP: DDP with sound multi-device defaults"),
            ("solo_ddp_notebook", "fork", "SoloDDP with the fork launcher, for Jupyter/IPython"),
        ):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, start_method=start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.root_device.type == "cpu":
            # Lightning's launchers already split the cores between local ranks; record what is in force.
            self._decide(Decision("cpu_threads", torch.get_num_threads(), "cores split between local processes"))
        self._decide(Decision("process_group_backend", self._process_group_backend, "nccl on CUDA, gloo otherwise"))

    def settings(self) -> dict[str, Any]:
        """The effective DDP settings, for the run summary."""
        return {
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "backend": self._process_group_backend,
            "start_method": self._start_method,
            "timeout_s": self._timeout.total_seconds() if self._timeout else None,
            **self._ddp_kwargs,
        }
