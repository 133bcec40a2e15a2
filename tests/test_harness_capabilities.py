"""The numerics tests' ATen CPU capabilities: one this CPU lacks is skipped, not run. torch takes
ATEN_CPU_CAPABILITY=avx512 on a CPU without AVX-512 and its ranks die of SIGILL at the first
such kernel (seen on an AMD EPYC with AVX2 only)."""

from __future__ import annotations

import pytest

from ringtrain.testing import spawn


def test_the_cpus_own_choice_and_the_plainer_ones_run() -> None:
    own = spawn._own_capability().lower()
    for capability in spawn.CAPABILITIES:
        runs = spawn._cpu_runs(capability)
        if own in spawn.CAPABILITIES:
            assert runs == (spawn.CAPABILITIES.index(capability) <= spawn.CAPABILITIES.index(own))
        else:
            assert runs == (capability == "default")


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
