"""Models: a LightningModule over any torchvision classifier."""

from lightning_solo.models.classifier import ImageClassifier, build_backbone

__all__ = ["ImageClassifier", "build_backbone"]
