"""lightning_solo: data-parallel training on 1..N GPUs that is correct and fast by default.

Importing the package registers the strategy names ``"solo_ddp"`` and ``"solo_ddp_notebook"`` with
Lightning, so ``Trainer(strategy="solo_ddp")`` works as well as ``Trainer(strategy=SoloDDP())``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_solo.checkpoint import SoloCheckpointIO, resolve_ckpt_path
from lightning_solo.comm.hooks import CommHook
from lightning_solo.decision import Decision
from lightning_solo.precision.plugin import SoloMixedPrecision
from lightning_solo.strategy import SoloDDP, SoloFSDP
from lightning_solo.syncbn.layer import SoloSyncBatchNorm

SoloDDP.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = [
    "CommHook",
    "Decision",
    "SoloCheckpointIO",
    "SoloDDP",
    "SoloFSDP",
    "SoloMixedPrecision",
    "SoloSyncBatchNorm",
    "__version__",
    "resolve_ckpt_path",
]
