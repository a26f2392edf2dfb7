"""Models: a LightningModule over any torchvision classifier, and a small CNN for small images."""

from lightning_solo.app.models.classifier import ImageClassifier, build_backbone
from lightning_solo.app.models.small_cnn import SmallCNN

__all__ = ["ImageClassifier", "SmallCNN", "build_backbone"]
