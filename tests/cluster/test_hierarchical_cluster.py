"""Hierarchical allreduce across namespace hosts, launched by ``ringtrain run`` over ssh.

Two placements the flat ring handles badly: 4-3-1 over three hosts (uneven) and a round-robin
rank order (``--placement round-robin``: h0, h1, h0, h1, ...). In both, every rank trains a small
model with ``DistributedOptimizer`` and checks, after a few steps, that its weights are what plain
gradient averaging gives: it computes every rank's gradient itself (the data are seeded by rank)
and applies their mean. The round-robin job trains twice in one launch (hierarchical on, then
off). The placement is read back from the runtime (measured host names), not from the
launcher's plan.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ringtrain.testing import cluster as tc

pytestmark = pytest.mark.cluster
CLUSTER = 3
PY = sys.executable
TIMEOUT_S = 240

RANK = textwrap.dedent(
    """
    import socket, sys
    import torch
    import torch.nn.functional as F
    import ringtrain as rt
    from ringtrain.runtime import state

    torch.set_num_threads(1)
    rt.init()
    rank, size = rt.rank(), rt.size()

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
        )

    def batch(step, r):
        g = torch.Generator().manual_seed(1000 * step + r)
        return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)

    def check(hierarchical):
        model, ref = net(), net()
        # Every tensor in its own bucket: several buckets go through the hierarchical path.
        opt = rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            hierarchical=hierarchical,
            fusion_threshold_bytes=0,
        )
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(4):
            opt.zero_grad()
            F.cross_entropy(model(batch(step, rank)[0]), batch(step, rank)[1]).backward()
            opt.step()
            # The reference: the mean of every rank's gradient, computed here.
            ref_opt.zero_grad()
            for r in range(size):
                x, y = batch(step, r)
                (F.cross_entropy(ref(x), y) / size).backward()
            ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        hosts = "".join(h[-1] for h in state.current().topology.hosts)
        print(f"OK rank {rank} host {socket.gethostname()} hier {opt.hierarchical} "
              f"hosts {hosts} asked {hierarchical}", flush=True)
        opt.remove_hooks()

    # One launch checks each setting asked for, one after the other, in the same world.
    for hierarchical in sys.argv[1].split(","):
        check(hierarchical)
    rt.shutdown()
    """
)


def _run(cluster: tc.Cluster, tmp_path: Path, hosts: str, hierarchical: str, *flags: str) -> str:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    argv = [PY, "-m", "ringtrain", "run", "--ssh-config-file", str(cluster.ssh_config_path)]
    argv += ["-H", hosts, *flags, "--", PY, str(script), hierarchical]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _ok_lines(out: str, asked: str) -> dict[int, tuple[str, str, str]]:
    """rank -> (host, hierarchical, placement string) from the ranks' OK lines for the
    ``hierarchical=asked`` model."""
    found = {}
    for line in out.splitlines():
        words = line.split()
        if "OK" in words:
            i = words.index("OK")
            if words[i + 10] == asked:
                found[int(words[i + 2])] = (words[i + 4], words[i + 6], words[i + 8])
    return found


def test_uneven_4_3_1_trains_like_plain_averaging(cluster: tc.Cluster, tmp_path: Path) -> None:
    found = _ok_lines(_run(cluster, tmp_path, "h0:4,h1:3,h2:1", "auto"), "auto")
    assert sorted(found) == list(range(8))
    assert {found[r][0] for r in range(8)} == {"h0", "h1", "h2"}
    # "auto" picks the hierarchical allreduce for an uneven placement; all agree on it.
    assert {v[1:] for v in found.values()} == {("True", "00001112")}


def test_round_robin_order_with_and_without_hierarchy(cluster: tc.Cluster, tmp_path: Path) -> None:
    # One job trains a model with the hierarchical allreduce, then one without.
    out = _run(cluster, tmp_path, "h0:2,h1:2", "on,off", "--placement", "round-robin")
    for hierarchical, expect in (("on", "True"), ("off", "False")):
        found = _ok_lines(out, hierarchical)
        assert [found[r][0] for r in range(4)] == ["h0", "h1", "h0", "h1"], out
        assert {v[1:] for v in found.values()} == {(expect, "0101")}
