"""Mixed precision: the rule (rule.py: ``"auto"`` agreed by all ranks, SoloDDP against the Trainer, GradScaler
settings) and the plugin (plugin.py: :class:`SoloMixedPrecision`, resume-safe, settled once the device is known)."""

from lightning_solo.ddp.precision.plugin import SoloMixedPrecision, decide_precision_plugin, pending_plugin
from lightning_solo.ddp.precision.rule import precision_options

__all__ = ["SoloMixedPrecision", "decide_precision_plugin", "pending_plugin", "precision_options"]
