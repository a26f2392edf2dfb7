"""Callbacks: one public callback per module."""

from lightning_solo.callbacks.batch_size.auto_batch_size import AutoBatchSize
from lightning_solo.callbacks.lr.warmup import WarmupScaledLR
from lightning_solo.callbacks.predictions import OrderedPredictions
from lightning_solo.callbacks.requeue import SlurmRequeue
from lightning_solo.callbacks.solo_checkpoint import SoloCheckpoint
from lightning_solo.diagnostics.doctor.training_doctor import TrainingDoctor
from lightning_solo.diagnostics.loss_watch import LossWatch
from lightning_solo.diagnostics.preflight import Preflight
from lightning_solo.diagnostics.profiler_window import ProfilerWindow
from lightning_solo.diagnostics.resource_monitor import ResourceMonitor

__all__ = [
    "AutoBatchSize",
    "LossWatch",
    "OrderedPredictions",
    "Preflight",
    "ProfilerWindow",
    "ResourceMonitor",
    "SlurmRequeue",
    "SoloCheckpoint",
    "TrainingDoctor",
    "WarmupScaledLR",
]
