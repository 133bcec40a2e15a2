"""Stands in for ``torchvision.models`` in the example re-creations: no torchvision build for
the CPU torch 2.13 loads here (0.28.0's extension needs the CUDA torch libraries)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_resnet(num_classes: int = 10) -> nn.Module:
    """A small residual conv net on 3x32x32 images (the synthetic benchmark's model)."""
    return _TinyResNet(num_classes)


class _TinyResNet(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
        )
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        x = torch.relu(x + self.block(x))
        return self.head(x.mean(dim=(2, 3)))


class MnistNet(nn.Module):
    """The classic two-conv MNIST net (28x28 inputs, 10 classes, log-probabilities out)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(torch.max_pool2d(self.conv1(x), 2))
        x = torch.relu(torch.max_pool2d(self.drop(self.conv2(x)), 2))
        x = torch.relu(self.fc1(x.flatten(1)))
        x = nn.functional.dropout(x, training=self.training)
        return torch.log_softmax(self.fc2(x), dim=1)
