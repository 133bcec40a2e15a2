"""MNIST in torchvision's on-disk layout, made from scikit-learn's bundled digits (nothing is
downloaded, and scikit-learn is not imported), and a reader for it with
``torchvision.datasets.MNIST``'s signature."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MEAN, STD = 0.1307, 0.3081  # MNIST's, as the examples normalise with them


def _raw(root: str | Path) -> Path:
    return Path(root) / "MNIST" / "raw"


def write_idx(root: str | Path, n_train: int, n_test: int) -> None:
    """The four idx files torchvision reads, 8x8 digits upscaled to 28x28 uint8 images."""
    from ringtrain.bench.converge_tasks import load_digits

    small, target = load_digits()
    big = F.interpolate(small, size=(28, 28), mode="bilinear", align_corners=False)
    images = (big.squeeze(1).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    labels = target.numpy().astype(np.uint8)
    assert n_train + n_test <= len(labels), "the digits data has 1797 images"
    raw = _raw(root)
    raw.mkdir(parents=True, exist_ok=True)
    for split, sl in (("train", slice(0, n_train)), ("t10k", slice(n_train, n_train + n_test))):
        imgs, labs = images[sl], labels[sl]
        (raw / f"{split}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 0x803, len(imgs), 28, 28) + imgs.tobytes()
        )
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 0x801, len(labs)) + labs.tobytes()
        )


def _read(path: Path, dims: int) -> torch.Tensor:
    data = path.read_bytes()
    magic, *shape = struct.unpack(">" + "I" * (dims + 1), data[: 4 * (dims + 1)])
    assert magic == 0x800 + dims, f"{path}: not an idx{dims} file"
    return torch.frombuffer(bytearray(data[4 * (dims + 1) :]), dtype=torch.uint8).reshape(shape)


def normalize(img: torch.Tensor) -> torch.Tensor:
    """ToTensor() then Normalize((0.1307,), (0.3081,)), on a 28x28 uint8 image."""
    return ((img.float() / 255.0) - MEAN).div(STD).unsqueeze(0)


class MNIST(torch.utils.data.Dataset[Any]):
    """``torchvision.datasets.MNIST(root, train, download, transform)`` over local files."""

    def __init__(
        self,
        root: str,
        train: bool = True,
        download: bool = False,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        split = "train" if train else "t10k"
        raw = _raw(root)
        if not (raw / f"{split}-images-idx3-ubyte").exists():
            raise FileNotFoundError(f"no MNIST files under {raw} (nothing can be downloaded here)")
        self.data = _read(raw / f"{split}-images-idx3-ubyte", 3)
        self.targets = _read(raw / f"{split}-labels-idx1-ubyte", 1).long()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = self.data[i]
        return (self.transform(img) if self.transform else img), int(self.targets[i])
