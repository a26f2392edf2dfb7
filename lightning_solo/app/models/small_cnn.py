"""SmallCNN: a four-convolution network sized for small images (the 8×8 digits, 16×16 synthetic images).
See docs/runner.md."""

from __future__ import annotations

import torch
from torch import nn


def _conv(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class SmallCNN(nn.Module):
    """conv-conv-pool-conv-conv-global-average-pool-linear, BatchNorm after each convolution; any input size."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32) -> None:
        super().__init__()
        self.input_shape = (in_channels, 8, 8)  # what the exporter traces with
        self.features = nn.Sequential(
            *_conv(in_channels, width),
            *_conv(width, width),
            nn.MaxPool2d(2),
            *_conv(width, 2 * width),
            *_conv(2 * width, 2 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))
