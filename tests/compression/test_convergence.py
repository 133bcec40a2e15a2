"""Convergence through DistributedOptimizer: every bandwidth saver trains like uncompressed.

Two tasks, 2 ranks, each rank on its own shard, the same steps, seeds and initial model for
every method; only the gradient exchange differs: ``none``, ``fp16``, ``powersgd`` and ``topk``
(by registered name, so with the Config's defaults: PowerSGD rank 2 after 10 uncompressed
steps, top-k 1%), and ``hierarchical="on"`` (both ranks on one pretend host, so buckets go
through the reduce-scatter / allgather phases).

* **digits**: the demo's CNN (examples/train_digits.py) on scikit-learn's digits, SGD with
  momentum; held-out loss and accuracy.
* **lm**: a one-block causal transformer on token sequences from a fixed random Markov chain
  (each token has a likely successor), Adam; held-out next-token loss, whose floor is the
  chain's entropy.

Stated tolerances, against uncompressed training of the same steps (measured values in the
constants' comments), and the ranks' weights identical after every run:

* digits: held-out loss at most ``LOSS_FACTOR`` x uncompressed + ``LOSS_SLACK``, accuracy at
  most ``ACCURACY_DROP`` below (both averaged over the last evaluations);
* lm: held-out loss at most ``LM_SLACK`` nats above uncompressed (guessing is log 16 = 2.77,
  the chain's entropy 1.42).

Top-k at 1% lags most at this size (a 0.2M-parameter model sends ~2,000 entries per step); fp16
and hierarchical are within rounding of uncompressed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import ringtrain as rt
from _training import DigitsNet, same_on_every_rank
from ringtrain.bench.converge_tasks import load_digits
from ringtrain.testing.spawn import World

METHODS: dict[str, dict[str, Any]] = {
    "none": {},
    "fp16": {"compression": "fp16"},
    "powersgd": {"compression": "powersgd"},
    "topk": {"compression": "topk"},
    "hierarchical": {"hierarchical": "on"},
}
ONE_HOST = [{"RINGTRAIN_HOSTNAME": "host-a"}] * 2
# Digits, 300 steps (loss / accuracy): none 0.088 / 97.5%, PowerSGD 0.089-0.095 / 97.4-97.5%,
# top-k 0.110-0.119 / 96.3-96.6%; fp16 within 0.002 / 0.2 points of none, hierarchical as none.
# The ranges: under ATEN_CPU_CAPABILITY default, avx2 and avx512 on an AMD EPYC, whose kernels'
# rounding moves the compressed runs. Top-k's drop, the largest, stays 1.3 points inside the
# bound, over 3 standard deviations of a one-seed drop on these 360 held-out images (about 0.4
# points: tests/engine/test_local_update_convergence.py); its loss 0.03 inside.
LOSS_FACTOR, LOSS_SLACK = 1.5, 0.02
ACCURACY_DROP = 0.025
# LM, 120 steps: none 1.434, fp16 1.434, hierarchical 1.434, PowerSGD 1.443, top-k 1.489, the
# same to 3 decimals under each of the three capabilities.
LM_SLACK = 0.1


def _optimizer(model: torch.nn.Module, base: torch.optim.Optimizer, kwargs: dict[str, Any]) -> Any:
    return rt.DistributedOptimizer(base, named_parameters=model.named_parameters(), **kwargs)


# ---- digits -------------------------------------------------------------------------------------

DIGITS_STEPS = 300
# Held-out figures are averaged over evaluations every EVAL_EVERY steps in the last EVAL_LAST
# steps: one evaluation swings by tens of percent from step to step at this size.
EVAL_EVERY, EVAL_LAST = 20, 100


def _held_out(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Held-out loss and accuracy, each rank scoring its share of the images (every rank holds
    the same weights here), so an evaluation costs each rank half of one."""
    r, n = rt.rank(), rt.size()
    with torch.no_grad():
        logits = model(x[r::n])
        sums = torch.stack(
            [
                F.cross_entropy(logits, y[r::n], reduction="sum"),
                (logits.argmax(1) == y[r::n]).sum().float(),
            ]
        )
    loss, right = rt.allreduce(sums, op=rt.Sum, name="held-out").tolist()
    return loss / len(y), right / len(y)


def _digits(
    methods: list[str], steps: int = DIGITS_STEPS, batch_size: int = 32
) -> dict[str, tuple[float, float, bool]]:
    r, n = rt.rank(), rt.size()
    x, y = load_digits()  # scikit-learn's file, without importing scikit-learn in every rank
    test = torch.arange(len(x)) % 5 == 0  # a fixed held-out fifth
    x_tr, y_tr, x_te, y_te = x[~test], y[~test], x[test], y[test]
    mine = torch.arange(r, len(x_tr), n)
    out = {}
    for method in methods:
        torch.manual_seed(0)
        model = DigitsNet()
        base = torch.optim.SGD(model.parameters(), lr=0.01 * n, momentum=0.9)
        opt = _optimizer(model, base, METHODS[method])
        gen = torch.Generator().manual_seed(r)
        evals: list[tuple[float, float]] = []
        for step in range(1, steps + 1):
            batch = mine[torch.randint(len(mine), (batch_size,), generator=gen)]
            opt.zero_grad()
            F.cross_entropy(model(x_tr[batch]), y_tr[batch]).backward()
            opt.step()
            if step > steps - EVAL_LAST and step % EVAL_EVERY == 0:
                evals.append(_held_out(model, x_te, y_te))
        loss = sum(e[0] for e in evals) / len(evals)
        acc = sum(e[1] for e in evals) / len(evals)
        out[method] = (loss, acc, same_on_every_rank(model))
        opt.remove_hooks()
    return out


def test_digits_every_method_within_tolerance(world2: World) -> None:
    results = world2.run(_digits, list(METHODS), DIGITS_STEPS, 16, env=ONE_HOST, timeout=120)[0]
    report = ", ".join(f"{m}: loss {lo:.4f} acc {a:.3f}" for m, (lo, a, _) in results.items())
    print(f"digits, {DIGITS_STEPS} steps: {report}")  # pytest -s shows the measured figures
    exact_loss, exact_acc, _ = results["none"]
    assert exact_acc > 0.9, report  # the task itself is learnt
    for method, (loss, acc, same) in results.items():
        assert same, f"{method}: ranks' weights differ"
        assert loss <= exact_loss * LOSS_FACTOR + LOSS_SLACK, report
        assert acc >= exact_acc - ACCURACY_DROP, report


# ---- a tiny transformer language model ---------------------------------------------------------

VOCAB, SEQ, LM_STEPS = 16, 16, 120


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, 32)
        self.pos = torch.nn.Embedding(SEQ, 32)
        self.block = torch.nn.TransformerEncoderLayer(
            32, 2, 64, dropout=0.0, batch_first=True, norm_first=True
        )
        self.head = torch.nn.Linear(32, VOCAB)
        self.register_buffer(
            "mask", torch.triu(torch.full((SEQ, SEQ), float("-inf")), diagonal=1), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(self.block(h, src_mask=self.mask, is_causal=True))


def _chain() -> torch.Tensor:
    """Transition matrix: each token goes to one likely successor with probability 0.7."""
    g = torch.Generator().manual_seed(1234)
    successor = torch.randperm(VOCAB, generator=g)
    probs = torch.full((VOCAB, VOCAB), 0.3 / (VOCAB - 1))
    probs[torch.arange(VOCAB), successor] = 0.7
    return probs


def _sequences(probs: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    seq = torch.empty(count, SEQ + 1, dtype=torch.int64)
    seq[:, 0] = torch.randint(VOCAB, (count,), generator=gen)
    for t in range(SEQ):
        seq[:, t + 1] = torch.multinomial(probs[seq[:, t]], 1, generator=gen).squeeze(1)
    return seq


def _lm(methods: list[str], steps: int = LM_STEPS) -> dict[str, tuple[float, float, bool]]:
    r = rt.rank()
    probs = _chain()
    held_out = _sequences(probs, 256, torch.Generator().manual_seed(99))
    out = {}
    for method in methods:
        torch.manual_seed(0)
        model = TinyLM()
        opt = _optimizer(model, torch.optim.Adam(model.parameters(), lr=3e-3), METHODS[method])
        gen = torch.Generator().manual_seed(1 + r)  # each rank its own stream of sequences
        for _ in range(steps):
            seq = _sequences(probs, 16, gen)
            opt.zero_grad()
            logits = model(seq[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten()).backward()
            opt.step()
        with torch.no_grad():
            logits = model(held_out[:, :-1])
            loss = float(F.cross_entropy(logits.flatten(0, 1), held_out[:, 1:].flatten()))
        out[method] = (loss, 0.0, same_on_every_rank(model))
        opt.remove_hooks()
    return out


def _entropy_floor() -> float:
    p = _chain()
    return float(-(p * p.log()).sum(1).mean())


def test_transformer_lm_every_method_within_tolerance(world2: World) -> None:
    results = world2.run(_lm, list(METHODS), env=ONE_HOST, timeout=120)[0]
    report = ", ".join(f"{m}: loss {lo:.4f}" for m, (lo, _, _) in results.items())
    exact, _, _ = results["none"]
    floor = _entropy_floor()
    print(f"lm, {LM_STEPS} steps: {report}; floor {floor:.4f}")
    uniform = float(torch.log(torch.tensor(float(VOCAB))))
    # The task is learnt: most of the way from guessing (log 16) to the chain's entropy.
    assert exact < floor + 0.25 * (uniform - floor), f"{report}; floor {floor:.4f}"
    for method, (loss, _, same) in results.items():
        assert same, f"{method}: ranks' weights differ"
        assert loss <= exact + LM_SLACK, f"{report}; floor {floor:.4f}"
