"""lightning_solo: data-parallel training on 1..N GPUs that is correct and fast by default.

The public API; the layout of the code is in docs/design.md. Importing the package registers the strategy
names ``"solo_ddp"`` and ``"solo_ddp_notebook"`` with Lightning, so ``Trainer(strategy="solo_ddp")`` works as
well as ``Trainer(strategy=SoloDDP())``.
"""

import gc

# The cyclic collector paused while Lightning loads (a million objects, no garbage): 12 % less CPU per process start
# (benchmarks/bench_startup.py). The caller's setting comes back.
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

__all__ = ["Decision", "SoloCheckpointIO", "SoloDDP", "SoloFSDP", "__version__", "resolve_ckpt_path"]
