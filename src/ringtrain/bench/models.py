"""Model presets for ``ringtrain bench train``: MLPs, CNNs and GPT-like LMs of ~1M to ~100M params.

Each preset names a parameter count (``mlp-10m`` has about 10 million parameters; a test keeps
every preset within 20% of its name) and knows how to make a synthetic batch and its loss, so
throughput can be measured without a data set. The architectures are ordinary on purpose: what a
benchmark of gradient exchange needs is a realistic mix of tensor sizes (many small biases and
norms, a few big matrices) and a realistic compute-to-bytes ratio, not a state-of-the-art model.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ringtrain.bench.catalog import MODELS
from ringtrain.errors import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Preset:
    """A model, a synthetic batch maker and a loss, under one name."""

    name: str
    description: str
    nominal_params: int
    default_batch_size: int
    build: Callable[[], nn.Module]
    # (batch_size, generator) -> (inputs, targets)
    make_batch: Callable[[int, torch.Generator], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---- MLP on flat 1024-feature inputs, 10 classes -------------------------------------------------


def _mlp(widths: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # no activation after the classifier


def _flat_batch(features: int) -> Callable[[int, torch.Generator], Batch]:
    def make(b: int, g: torch.Generator) -> Batch:
        return torch.randn(b, features, generator=g), torch.randint(0, 10, (b,), generator=g)

    return make


# ---- CNN on 3x32x32 images (CIFAR-sized), 10 classes ---------------------------------------------


def _cnn(channels: list[int], hidden: int) -> nn.Module:
    layers: list[nn.Module] = []
    c_in = 3
    for i, c in enumerate(channels):
        layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()]
        if i > 0:  # 32 -> 16 -> 8 -> 4 for four conv stages
            layers.append(nn.MaxPool2d(2))
        c_in = c
    side = 32 // 2 ** (len(channels) - 1)
    layers += [
        nn.Flatten(),
        nn.Linear(c_in * side * side, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    ]
    return nn.Sequential(*layers)


def _image_batch(b: int, g: torch.Generator) -> Batch:
    return torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)


# ---- GPT-like causal language model --------------------------------------------------------------


class TinyGPT(nn.Module):
    """A decoder-only transformer: token + position embeddings, pre-norm blocks, untied LM head."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        # A ModuleList rather than nn.TransformerEncoder: the latter warns about nested tensors
        # with norm_first, and we need nothing else from it.
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model,
                heads,
                4 * d_model,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.mask: torch.Tensor
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))  # (batch, seq, vocab)


def _lm_batch(vocab: int, seq_len: int) -> Callable[[int, torch.Generator], Batch]:
    def make(b: int, g: torch.Generator) -> Batch:
        tokens = torch.randint(0, vocab, (b, seq_len + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return make


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _gpt(vocab: int, d: int, layers: int, heads: int, seq: int) -> Callable[[], nn.Module]:
    return lambda: TinyGPT(vocab, d, layers, heads, seq)


_ce = nn.functional.cross_entropy

# Batch sizes are per rank. The transformer sizes are chosen so one step of transformer-25m takes
# roughly half a second on one core of a 2020s x86 CPU: slow enough that gradient exchange
# (~100 MB per step) competes with compute as it does on real jobs, fast enough to bench often.
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "mlp-1m",
            MODELS["mlp-1m"],
            1_000_000,
            64,
            lambda: _mlp([1024, 640, 512, 10]),
            _flat_batch(1024),
            _ce,
        ),
        Preset(
            "mlp-10m",
            MODELS["mlp-10m"],
            10_000_000,
            64,
            lambda: _mlp([1024, 2048, 2048, 1536, 10]),
            _flat_batch(1024),
            _ce,
        ),
        Preset(
            "cnn-small",
            MODELS["cnn-small"],
            1_000_000,
            32,
            lambda: _cnn([32, 64, 128, 128], 384),
            _image_batch,
            _ce,
        ),
        Preset(
            "cnn",
            MODELS["cnn"],
            10_000_000,
            32,
            lambda: _cnn([64, 128, 256, 512], 1024),
            _image_batch,
            _ce,
        ),
        Preset(
            "transformer-25m",
            MODELS["transformer-25m"],
            25_000_000,
            4,
            _gpt(6144, 512, 6, 8, 64),
            _lm_batch(6144, 64),
            _lm_loss,
        ),
        Preset(
            "transformer-100m",
            MODELS["transformer-100m"],
            100_000_000,
            2,
            _gpt(8192, 768, 12, 12, 64),
            _lm_batch(8192, 64),
            _lm_loss,
        ),
    ]
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}.\nHINT: choose one of {', '.join(PRESETS)}."
        ) from None
