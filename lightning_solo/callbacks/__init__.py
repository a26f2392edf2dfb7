"""Callbacks: one public callback per module."""

from lightning_solo.callbacks.checkpoint import SoloCheckpoint
from lightning_solo.callbacks.doctor import TrainingDoctor
from lightning_solo.callbacks.lr import WarmupScaledLR

__all__ = ["SoloCheckpoint", "TrainingDoctor", "WarmupScaledLR"]
