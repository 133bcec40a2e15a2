"""DistributedOptimizer over hierarchical allreduce and several engine groups ("streams").

Ranks pretend to run on hosts given by ``RINGTRAIN_HOSTNAME`` (the runtime measures the placement
from it), so 3 and 4 local ranks can stand for uneven (2-1), round-robin (a, b, a, b) and
one-host placements. Whatever the streams, training must give the same weights as the plain
engine: same buckets, same sums, only the path differs.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.testing import spawn

SMALL_BUCKETS = {"fusion_threshold_bytes": 0}  # every tensor in its own bucket


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 24)
        self.b = torch.nn.Linear(24, 12)
        self.c = torch.nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _train(kwargs: dict[str, Any], steps: int = 4) -> tuple[torch.Tensor, bool, int]:
    r = rt.rank()
    torch.manual_seed(0)
    model = _Net()
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        **SMALL_BUCKETS,
        **kwargs,
    )
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + r)
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.plan is not None and len(opt.plan.buckets) > 2  # several buckets, several streams
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, opt.hierarchical, opt.streams


def _compare(variants: list[dict[str, Any]]) -> list[tuple[bool, int]]:
    """Train with the plain engine and with each variant; weights must agree."""
    want, hier, streams = _train({"hierarchical": "off", "engine_streams": 1})
    assert not hier and streams == 1
    seen = []
    for kwargs in variants:
        got, hier, streams = _train(kwargs)
        tol = (
            {"rtol": 2e-3, "atol": 2e-4}
            if kwargs.get("compression")
            else {"rtol": 1e-5, "atol": 1e-6}
        )
        torch.testing.assert_close(got, want, **tol, msg=lambda m, k=kwargs: f"{k}: {m}")  # type: ignore[misc]
        seen.append((hier, streams))
    return seen


VARIANTS = [
    {"hierarchical": "on"},
    {"hierarchical": "on", "engine_streams": 2},
    {"hierarchical": "off", "engine_streams": 3},
    {"hierarchical": "auto"},
    {"hierarchical": "on", "compression": "fp16"},
]


def _hosts(names: str) -> list[dict[str, str]]:
    return [{"RINGTRAIN_HOSTNAME": h} for h in names]


@pytest.mark.parametrize("hosts", ["aab", "aba"])
def test_world3_uneven_placement_same_weights(world3: spawn.World, hosts: str) -> None:
    for seen in world3.run(_compare, VARIANTS, env=_hosts(hosts), timeout=90):
        assert seen == [(True, 1), (True, 2), (False, 3), (True, 1), (True, 1)]


def test_world4_round_robin_same_weights() -> None:
    w = spawn.world(4)
    variants = [*VARIANTS[:2], {"hierarchical": "auto", "engine_streams": 2}]
    for seen in w.run(_compare, variants, env=_hosts("abab"), timeout=120):
        assert seen == [(True, 1), (True, 2), (True, 2)]


def test_auto_stays_flat_on_one_host(world2: spawn.World) -> None:
    # One host: nothing crosses hosts, so "auto" keeps the flat allreduce; "on" still works.
    for seen in world2.run(_compare, VARIANTS[3:4] + VARIANTS[:1], env=_hosts("aa")):
        assert seen == [(False, 1), (True, 1)]


def _streams_per_bucket(base: str) -> list[tuple[int, int]]:
    """(bucket, stream) of every bucket allreduce the timeline recorded."""
    from ringtrain.diagnostics import timeline

    rt.start_timeline(base)
    path = timeline.rank_path(base, rt.rank())
    _train({"engine_streams": 3}, steps=2)
    rt.stop_timeline()
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    return [
        (int(tracks[e["tid"]].removeprefix("bucket ")), e["args"]["stream"])
        for e in events
        if e["name"] == "ALLREDUCE" and tracks[e["tid"]].startswith("bucket ")
    ]


def test_bucket_i_travels_on_stream_i_mod_k(world2: spawn.World, tmp_path: Any) -> None:
    """docs/glossary.md (Stream): with engine_streams=k, bucket i goes on stream i % k."""
    for sent in world2.run(_streams_per_bucket, str(tmp_path / "t.json")):
        assert {bucket for bucket, _ in sent} == set(range(6))  # every tensor its own bucket
        assert all(stream == bucket % 3 for bucket, stream in sent), sent


def _env_settings() -> tuple[bool, int]:
    _, hier, streams = _train({}, steps=2)
    return hier, streams


def test_settings_from_environment(world2: spawn.World) -> None:
    env = [
        {"RINGTRAIN_HOSTNAME": h, "RINGTRAIN_HIERARCHICAL": "on", "RINGTRAIN_ENGINE_STREAMS": "2"}
        for h in "ab"
    ]
    assert world2.run(_env_settings, env=env) == [(True, 2), (True, 2)]


def test_rejects_bad_settings() -> None:
    with pytest.raises(rt.ConfigError, match="hierarchical"):
        rt.Config(hierarchical="yes")
    with pytest.raises(rt.ConfigError):
        rt.Config(engine_streams=0)
