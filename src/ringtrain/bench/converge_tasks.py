"""The tasks of ``ringtrain bench converge`` (:mod:`ringtrain.bench.converge`): a model, its
data and what counts as good enough.

* ``digits``: scikit-learn's 8x8 handwritten digits, the CNN of ``examples/train_digits.py``;
  quality is test accuracy.
* ``lm``: a small transformer language model on text from a fixed random Markov chain whose
  entropy rate is known exactly; quality is the held-out loss in nats per token.
* ``mlp``: regression of a fixed random teacher network's output (plus noise) by a ~1.1M-
  parameter MLP; quality is the held-out mean squared error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ringtrain.bench import catalog
from ringtrain.errors import ConfigError

TASKS = catalog.CONVERGE_TASKS
MLP_INPUTS = 64
MLP_WIDTH = 1024  # two hidden layers: 64*1024 + 1024*1024 + 1024 weights, ~1.1M parameters
# Training samples: with 8,192 the 1.1M-parameter student overfit, its held-out mse hovering at
# 1.2-1.5 from step 100 on, so a target's time was luck; with 65,536 (and lr 2e-4) it falls
# steadily for thousands of steps.
MLP_TRAIN = 65536
MLP_TARGET_SHARE = 0.065  # default target: this share of the test targets' variance
LM_VOCAB = 32
LM_CONTEXT = 32
LM_SUCCESSORS = 3  # likely next tokens per context: a learnable, far-from-uniform chain
LM_MARGIN = 0.15  # nats per token above the chain's entropy rate: the default target


class DigitsNet(nn.Module):
    """examples/train_digits.py's CNN."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class TinyLM(nn.Module):
    """A two-layer causal transformer over :data:`LM_VOCAB` tokens."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(LM_VOCAB, width)
        self.pos = nn.Parameter(torch.zeros(LM_CONTEXT, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, 0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, LM_VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.body(h, mask=mask, is_causal=True))


class RegressionMLP(nn.Module):
    """Two hidden layers of :data:`MLP_WIDTH`, one output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(MLP_INPUTS, MLP_WIDTH),
            nn.ReLU(),
            nn.Linear(MLP_WIDTH, MLP_WIDTH),
            nn.ReLU(),
            nn.Linear(MLP_WIDTH, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(-1)


@dataclass
class Task:
    build: Callable[[], nn.Module]
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    metric: str
    target: float
    skip: int = 0  # lm: leading positions not counted (their token is uniform, unpredictable)
    lr: float = 1e-3  # Adam's, where the bench is not given one

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.metric == "mse":
            return F.mse_loss(out, y)
        if out.dim() == 3:
            out, y = out[:, self.skip :], y[:, self.skip :]
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def quality(self, model: nn.Module) -> float:
        out = model(self.test_x)
        if self.metric == "accuracy":
            return float((out.argmax(1) == self.test_y).float().mean())
        return float(self.loss(out, self.test_y))

    def good(self, q: float) -> bool:
        return q >= self.target if self.metric == "accuracy" else q <= self.target


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (images scaled to [0, 1], labels), read from the file the package
    ships, without importing scikit-learn (seconds per rank on a loaded machine)."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "bench converge --task digits needs scikit-learn's digits data.\n"
            "HINT: pip install 'ringtrain[demo]' (scikit-learn), or use --task lm."
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    path = package / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        rows = [[float(v) for v in line.split(",")] for line in f if line.strip()]
    data = torch.tensor(rows)
    return data[:, :64].reshape(-1, 1, 8, 8) / 16.0, data[:, 64].long()


def _digits(target: float | None, seed: int, width: int) -> Task:
    x, y = load_digits()
    # A stratified 0.2 test split, fixed: a fifth of every class, chosen by a seeded shuffle.
    g = torch.Generator().manual_seed(0)
    test = torch.zeros(len(y), dtype=torch.bool)
    for c in range(10):
        idx = (y == c).nonzero().squeeze(1)
        idx = idx[torch.randperm(len(idx), generator=g)]
        test[idx[: round(0.2 * len(idx))]] = True
    target = 0.95 if target is None else target
    return Task(DigitsNet, x[~test], y[~test], x[test], y[test], "accuracy", target)


def markov_chain(seed: int) -> tuple[torch.Tensor, float]:
    """The order-2 chain's transition table ``[V, V, V]`` and its entropy rate (nats/token)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((LM_VOCAB, LM_VOCAB, LM_VOCAB), -6.0)
    for a in range(LM_VOCAB):
        for b in range(LM_VOCAB):
            picks = torch.randperm(LM_VOCAB, generator=g)[:LM_SUCCESSORS]
            logits[a, b, picks] = torch.randn(LM_SUCCESSORS, generator=g)
    table = logits.softmax(-1)
    entropy = -(table * table.log()).sum(-1)  # per context
    # The stationary distribution of contexts, by power iteration over (a, b) -> (b, c).
    pi = torch.full((LM_VOCAB, LM_VOCAB), 1.0 / LM_VOCAB**2)
    for _ in range(200):
        pi = torch.einsum("ab,abc->bc", pi, table)
    return table, float((pi * entropy).sum())


def _sample(table: torch.Tensor, count: int, g: torch.Generator) -> torch.Tensor:
    seq = torch.zeros(count, LM_CONTEXT + 1, dtype=torch.int64)
    seq[:, :2] = torch.randint(0, LM_VOCAB, (count, 2), generator=g)
    for t in range(2, LM_CONTEXT + 1):
        probs = table[seq[:, t - 2], seq[:, t - 1]]
        seq[:, t] = torch.multinomial(probs, 1, generator=g).squeeze(1)
    return seq


def _mlp(target: float | None, seed: int, width: int) -> Task:
    """A random teacher (64 -> 32 tanh -> 1) plus noise of a tenth of its spread."""
    g = torch.Generator().manual_seed(seed + 7)
    w1, w2 = torch.randn(MLP_INPUTS, 32, generator=g) / 8, torch.randn(32, generator=g)
    x = torch.randn(MLP_TRAIN + 1024, MLP_INPUTS, generator=g)
    clean = torch.tanh(x @ w1) @ w2
    y = clean + 0.1 * clean.std() * torch.randn(clean.shape, generator=g)
    train_x, test_x = x[:MLP_TRAIN], x[MLP_TRAIN:]
    train_y, test_y = y[:MLP_TRAIN], y[MLP_TRAIN:]
    share = MLP_TARGET_SHARE * float(test_y.var())
    target = share if target is None else target
    # Adam at 1e-3 leaves this width's held-out mse hovering; at 2e-4 it falls steadily.
    return Task(RegressionMLP, train_x, train_y, test_x, test_y, "mse", target, lr=2e-4)


def _lm(target: float | None, seed: int, width: int) -> Task:
    table, rate = markov_chain(seed)
    g = torch.Generator().manual_seed(seed + 1)
    train, test = _sample(table, 4096, g), _sample(table, 256, g)
    target = rate + LM_MARGIN if target is None else target
    # The first two tokens of a sequence are uniform: the loss counts from the third.
    return Task(
        lambda: TinyLM(width),
        train[:, :-1],
        train[:, 1:],
        test[:, :-1],
        test[:, 1:],
        "loss",
        target,
        skip=1,
    )


def build(name: str, target: float | None, seed: int, width: int) -> Task:
    """The task ``name`` (one of :data:`TASKS`); ``target`` None: the task's default."""
    return {"digits": _digits, "lm": _lm, "mlp": _mlp}[name](target, seed, width)
