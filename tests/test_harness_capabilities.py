"""The numerics tests' ATen CPU capabilities: one this CPU lacks is skipped, not run. torch takes
ATEN_CPU_CAPABILITY=avx512 on a CPU without AVX-512 and its ranks die of SIGILL at the first
such kernel (seen on an AMD EPYC with AVX2 only)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ringtrain import environ
from ringtrain.environ import Torch
from ringtrain.testing import spawn


def test_what_is_allowed_runs_a_kernel() -> None:
    """Each capability allowed here runs under its variable without SIGILL (one fresh process
    each: a process reads the variable once); the CPU's own choice is always allowed."""
    allowed = [c for c in spawn.CAPABILITIES if spawn._cpu_runs(c)]
    assert "default" in allowed
    code = (
        "import torch, torch.nn.functional as F; "
        "print(torch.backends.cpu.get_cpu_capability(), "
        "float(F.cross_entropy(torch.randn(64, 10), torch.zeros(64, dtype=torch.long))))"
    )
    for capability in allowed:
        env = {**environ.current(), Torch.ATEN_CPU_CAPABILITY: capability}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (capability, done.returncode, done.stderr[-2000:])
        assert done.stdout.split()[0] == capability.upper(), done.stdout


@pytest.mark.parametrize(
    ("own", "runnable"),
    [("AVX512", spawn.CAPABILITIES), ("AVX2", ("default", "avx2")), ("SVE256", ("default",))],
)
def test_a_capability_above_the_cpus_starts_no_ranks(
    monkeypatch: pytest.MonkeyPatch, own: str, runnable: tuple[str, ...]
) -> None:
    monkeypatch.setattr(spawn, "_own_capability", lambda: own)
    before = set(spawn._worlds)
    for capability in spawn.CAPABILITIES:
        assert spawn._cpu_runs(capability) == (capability in runnable)
        if capability not in runnable:
            assert spawn.capability_world(2, capability) is None
            assert set(spawn._worlds) == before  # no ranks started for it
