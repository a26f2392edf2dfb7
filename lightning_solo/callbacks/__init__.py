"""Callbacks: one public callback per module."""

from lightning_solo.callbacks.auto_batch_size import AutoBatchSize
from lightning_solo.callbacks.checkpoint import SoloCheckpoint
from lightning_solo.callbacks.lr import WarmupScaledLR
from lightning_solo.callbacks.predictions import OrderedPredictions
from lightning_solo.callbacks.requeue import SlurmRequeue

__all__ = ["AutoBatchSize", "OrderedPredictions", "SlurmRequeue", "SoloCheckpoint", "WarmupScaledLR"]
