"""lightning_solo: data-parallel training on 1..N GPUs that is correct and fast by default.

The public API; the layout of the code is in docs/design.md. Importing the package registers the strategy
names ``"solo_ddp"`` and ``"solo_ddp_notebook"`` with Lightning, so ``Trainer(strategy="solo_ddp")`` works as
well as ``Trainer(strategy=SoloDDP())``. Under ``python -m lightning_solo.<command>`` the API (and Lightning) is
imported at its first use instead, so that bad input fails first (docs/runner.md).
"""

import gc
import importlib
import sys
from typing import TYPE_CHECKING, Any


def _command() -> bool:
    """Whether this import starts ``python -m lightning_solo.<command>`` (``sys.argv[0]`` is "-m" meanwhile)."""
    argv = sys.orig_argv
    return sys.argv[:1] == ["-m"] and "-m" in argv[:-1] and argv[argv.index("-m") + 1].startswith("lightning_solo.")


if TYPE_CHECKING or not _command():
    # Importing Lightning (torch, torchmetrics, torchvision) makes about a million objects and none of them is garbage,
    # yet the cyclic collector walks them again and again while they load. Paused for these imports, a process starts
    # with 12 % less CPU, ~1 s here (benchmarks/bench_startup.py); every rank is such a process. The caller's setting
    # comes back.
    _collecting = gc.isenabled()
    gc.disable()
    try:
        from lightning.pytorch.strategies import StrategyRegistry

        from lightning_solo._version import __version__
        from lightning_solo.checkpoint import SoloCheckpointIO, resolve_ckpt_path
        from lightning_solo.core.decision import Decision
        from lightning_solo.ddp.strategy import SoloDDP
        from lightning_solo.fsdp.strategy import SoloFSDP
    finally:
        if _collecting:
            gc.enable()

    for _name, _start_method, _description in (
        ("solo_ddp", "auto", "SoloDDP: DDP with sound multi-device defaults"),
        ("solo_ddp_notebook", "fork", "SoloDDP with the fork launcher, for Jupyter/IPython"),
    ):
        if _name not in StrategyRegistry:
            StrategyRegistry.register(_name, SoloDDP, description=_description, start_method=_start_method)
else:

    def __getattr__(name: str) -> Any:
        """The API's first use under a command imports it: this module's body again, now in full."""
        if name not in __all__:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        del globals()["__getattr__"]
        return getattr(importlib.reload(sys.modules[__name__]), name)


__all__ = ["Decision", "SoloCheckpointIO", "SoloDDP", "SoloFSDP", "__version__", "resolve_ckpt_path"]
