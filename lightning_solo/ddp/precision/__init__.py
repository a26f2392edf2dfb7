"""Mixed precision: the rule (rule.py: ``"auto"`` agreed by all ranks, SoloDDP against the Trainer, GradScaler
settings) and the plugin (plugin.py: :class:`SoloMixedPrecision`, resume-safe, settled once the device is known)."""

from lightning_solo.ddp.precision.plugin import CHECKPOINT_KEY, EXTRA_KEY, SoloMixedPrecision, decide_precision_plugin
from lightning_solo.ddp.precision.rule import (
    agreed_rule,
    auto_precision,
    auto_rule,
    decide_precision,
    precision_options,
    scaler_settings,
)

__all__ = ["CHECKPOINT_KEY", "EXTRA_KEY", "SoloMixedPrecision", "agreed_rule", "auto_precision", "auto_rule",
           "decide_precision", "decide_precision_plugin", "precision_options", "scaler_settings"]  # fmt: skip
