"""What the training tests share: the demo's CNN, the plain training loop, the weight checks.

Imported by test modules and, through :mod:`ringtrain.testing.spawn`, by their ranks (which get
the test process's ``sys.path``, so ``tests/`` is on it). Seeds, data and tolerances stay in
the tests: this module only runs the steps and compares.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

import ringtrain as rt


class DigitsNet(torch.nn.Module):
    """The demo's CNN (examples/train_digits.py), for 8x8 one-channel images and 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = torch.nn.Linear(64 * 4 * 4, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def train(
    opt: torch.optim.Optimizer,
    steps: Iterable[int],
    loss: Callable[[int], torch.Tensor],
    after_step: Callable[[int], None] | None = None,
) -> None:
    """The plain loop: for every step, zero the gradients, backward ``loss(step)``, step.

    ``loss`` draws the step's batch itself, so each test keeps its own seeded generator;
    ``after_step`` looks at the model between steps (held-out evaluations).
    """
    for step in steps:
        opt.zero_grad()
        loss(step).backward()
        opt.step()
        if after_step is not None:
            after_step(step)


def same_on_every_rank(model: torch.nn.Module) -> bool:
    """Whether every rank holds bit-identical weights (one allgather of all of them)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = rt.allgather(flat.reshape(1, -1))
    return bool(torch.equal(gathered, gathered[:1].expand_as(gathered)))


def assert_same_weights(
    model: torch.nn.Module, reference: torch.nn.Module, rtol: float, atol: float
) -> float:
    """Assert ``model``'s weights equal ``reference``'s within the tolerance, naming the first
    parameter that does not; returns the largest difference."""
    worst = 0.0
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(
            got, want, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )
        worst = max(worst, float((got - want).abs().max()))
    return worst


def tiny_job(steps: int = 5) -> dict[str, object]:
    """The integration jobs' training (launchers, adoption, Spark): a tiny model, a different
    start on every rank (the broadcast must fix that), data that differs per rank, ``steps``
    steps through ``hvd.DistributedOptimizer``. Returns whether every rank ended with the same
    weights (gathered, compared bit for bit), whether training moved them, and their checksum.
    Imports ``ringtrain.torch`` only when called: scripts set up torch first."""
    import ringtrain.torch as hvd

    torch.manual_seed(100 + hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    data = torch.Generator().manual_seed(7 + hvd.rank())

    def loss(_: int) -> torch.Tensor:
        x = torch.randn(16, 8, generator=data)
        return (model(x) - x.sum(1, keepdim=True)).pow(2).mean()

    train(opt, range(steps), loss)
    end = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = hvd.allgather(end.unsqueeze(0))
    return {
        "identical": all(torch.equal(every[0], every[r]) for r in range(hvd.size())),
        "trained": not torch.equal(start, end),
        "checksum": float(end.double().sum()),
    }


def print_result(result: dict[str, object]) -> None:
    """Print ``RESULT {json}`` as one write of the whole line (under PIPE_BUF, so atomic): the
    ranks share the launcher's stdout pipe, and a line written in pieces (text, then newline)
    can interleave with another rank's."""
    import json
    import os
    import sys

    sys.stdout.flush()
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())
