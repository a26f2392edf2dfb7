"""Callbacks: one public callback per module."""

from lightning_solo.callbacks.checkpoint import SoloCheckpoint
from lightning_solo.callbacks.loss_watch import LossWatch
from lightning_solo.callbacks.lr import WarmupScaledLR
from lightning_solo.callbacks.preflight import Preflight
from lightning_solo.callbacks.profiler_window import ProfilerWindow
from lightning_solo.callbacks.resource_monitor import ResourceMonitor

__all__ = ["LossWatch", "Preflight", "ProfilerWindow", "ResourceMonitor", "SoloCheckpoint", "WarmupScaledLR"]
