"""Bucket plans for tests that feed the engine's tuner injected figures."""

from __future__ import annotations

from typing import Any


def plan_of(shapes: tuple[tuple[int, ...], ...]) -> Any:
    """A one-bucket float32 plan of these parameter shapes."""
    from ringtrain.engine import buckets as b

    specs = [b.ParamSpec(i, f"p{i}", s, "torch.float32", "cpu", 4) for i, s in enumerate(shapes)]
    obs = b.Observation(
        tuple(range(len(specs))),
        tuple(0 for _ in specs),
        tuple(False for _ in specs),
        tuple(True for _ in specs),
        tuple(s.numel for s in specs),
    )
    plan = b.agree(specs, [obs], threshold_bytes=1 << 30, cycle_time_ms=1.0, order="registration")
    assert len(plan.buckets) == 1
    return plan
