"""Callbacks: one public callback per module."""

from lightning_solo.callbacks.auto_batch_size import AutoBatchSize
from lightning_solo.callbacks.checkpoint import SoloCheckpoint
from lightning_solo.callbacks.doctor import TrainingDoctor
from lightning_solo.callbacks.loss_watch import LossWatch
from lightning_solo.callbacks.lr import WarmupScaledLR
from lightning_solo.callbacks.predictions import OrderedPredictions
from lightning_solo.callbacks.preflight import Preflight
from lightning_solo.callbacks.profiler_window import ProfilerWindow
from lightning_solo.callbacks.requeue import SlurmRequeue
from lightning_solo.callbacks.resource_monitor import ResourceMonitor

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
