"""Issue 6's "done when" items for mismatches, stalls and a compute-bound rank, across two
namespace hosts.

Both jobs run 4 ranks on ``h0`` and ``h1`` through ``ringtrain run``. The odd rank out is always
rank 3, on the second host, so every error has to cross the network to reach ranks 0-2.
Times come from the ranks' own clocks (the hosts share the machine's clock) and are measured from
the moment the offending collective is submitted, so ssh and torch start-up do not count.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _only_sshd import wait_for_only_sshd
from ringtrain.testing import cluster as tc

pytestmark = pytest.mark.cluster
CLUSTER = 2
PY = sys.executable
RANKS = 4
ERROR_WITHIN_S = 5.0

# One bad collective per difference that ringtrain.collectives.requests.mismatch tells apart
# (device type aside: these hosts have CPUs only), and one argument error found on one rank.
# Each entry: the ranks' call, and the words every rank's error must contain.
MISMATCHES = {
    "operation": "operation differs",
    "reduce-op": "reduce op differs",
    "root": "root rank differs",
    "scale": "scale factor differs",
    "count": "number of tensors differs",
    "dtype": "dtype differs",
    "shape": "shape differs",
    "gather-shape": "shape (all dimensions but the first must agree) differs",
    "invalid": "was invalid on rank 3: allreduce expects a torch.Tensor, got list",
    # Rank 3 submits on the set {2, 3}, the others on the world (ringtrain.collectives.crossset).
    "process-set": "was submitted on different process sets",
}

MISMATCH_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    import ringtrain as rt
    from ringtrain.errors import CollectiveError

    rt.init()
    odd = rt.rank() == 3
    pair = rt.add_process_set([2, 3])

    def bad(kind):
        name = "bad." + kind
        x = torch.ones(2)
        if kind == "operation":
            (rt.allgather if odd else rt.allreduce)(x, name=name)
        elif kind == "reduce-op":
            rt.allreduce(x, op=rt.Max if odd else rt.Sum, name=name)
        elif kind == "root":
            rt.broadcast(x, root_rank=1 if odd else 0, name=name)
        elif kind == "scale":
            rt.allreduce(x, op=rt.Sum, prescale_factor=2.0 if odd else 1.0, name=name)
        elif kind == "count":
            rt.grouped_allreduce([x] * (3 if odd else 2), name=name)
        elif kind == "dtype":
            rt.allreduce(x.double() if odd else x, name=name)
        elif kind == "shape":
            rt.allreduce(torch.ones(3) if odd else x, name=name)
        elif kind == "gather-shape":
            rt.allgather(torch.ones(2, 3 if odd else 2), name=name)
        elif kind == "invalid":
            rt.allreduce([1.0, 2.0] if odd else x, name=name)
        elif kind == "process-set":
            rt.allreduce(x, name=name, process_set=pair if odd else rt.global_process_set)

    for kind in sys.argv[1:]:
        rt.allreduce(torch.ones(1), name="sync." + kind)  # all ranks start together
        t0 = time.time()
        try:
            bad(kind)
        except CollectiveError as e:
            took = time.time() - t0
            print(f"ERROR {kind} {took:.3f} {type(e).__name__}: {e}".replace("\\n", " | "),
                  flush=True)
        else:
            print(f"NO-ERROR {kind}", flush=True)
    # The controller lives on after every mismatch: a good collective still works.
    total = rt.allreduce(torch.ones(1), op=rt.Sum, name="after")
    print(f"AFTER {int(total.item())}", flush=True)
    rt.shutdown()
    """
)

STALL_SCRIPT = textwrap.dedent(
    """
    import logging, time
    import torch
    import ringtrain as rt

    # Timestamps on ringtrain's log lines: the stall warning's time is part of what is tested.
    logging.basicConfig(format="%(created).3f %(levelname)s %(message)s")
    rt.init()
    rt.allreduce(torch.ones(1), name="warm-up")
    print(f"STALL-START {time.time():.3f}", flush=True)
    if rt.rank() != 3:
        rt.allreduce(torch.ones(1), name="grad.skipped")
    else:  # rank 3 skips it and waits in the next one, which the others never reach
        rt.allreduce(torch.ones(1), name="grad.next")
    print("NOT-REACHED", flush=True)
    """
)

COMPUTE_SCRIPT = textwrap.dedent(
    """
    import time
    import torch
    import ringtrain as rt

    rt.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters())
    a = torch.randn(128, 128)
    for _ in range(10):
        opt.zero_grad()
        loss = model(torch.randn(16, 32)).pow(2).mean()
        if rt.rank() == 3:  # real extra work, as if this rank's cores were shared
            busy_until = time.perf_counter() + 0.15
            while time.perf_counter() < busy_until:
                a = torch.tanh(a @ a)
        loss.backward()
        opt.step()
    report = rt.straggler_report()
    print("REPORT", report.kind, list(report.ranks), list(report.hosts), flush=True)
    rt.shutdown()
    """
)


def _ringtrain_run(
    cluster: tc.Cluster, tmp_path: Path, script: str, *flags: str, args: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess[str], float]:
    """The finished job, and when it finished (wall clock, comparable with the ranks' times)."""
    path = tmp_path / "job.py"
    path.write_text(script)
    argv = [PY, "-m", "ringtrain", "run", *cluster.launcher_args(slots=2), "--start-timeout", "20"]
    proc = subprocess.run(
        [*argv, *flags, "--", PY, str(path), *args],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
    )
    return proc, time.time()


def test_each_mismatch_kind_fails_on_every_rank_within_seconds(
    cluster: tc.Cluster, tmp_path: Path
) -> None:
    proc, _ = _ringtrain_run(cluster, tmp_path, MISMATCH_SCRIPT, args=tuple(MISMATCHES))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "NO-ERROR" not in proc.stdout, log
    errors = re.findall(r"^\[(\d)\] ERROR (\S+) ([\d.]+) (.*)$", proc.stdout, re.M)
    for kind, words in MISMATCHES.items():
        got = {int(rank): (float(took), msg) for rank, k, took, msg in errors if k == kind}
        assert sorted(got) == list(range(RANKS)), f"{kind}: errors on ranks {sorted(got)}\n{log}"
        for rank, (took, msg) in got.items():
            assert took < ERROR_WITHIN_S, f"{kind}: rank {rank} waited {took:.1f} s"
            assert words in msg, f"{kind}, rank {rank}: {msg}"
            if kind == "invalid":
                assert msg.startswith("CollectiveArgumentError:"), msg
                continue
            # The message lists what each rank submitted: ranks 0-2 alike, rank 3 apart.
            assert msg.startswith("CollectiveMismatchError:"), msg
            if kind == "process-set":
                assert "ranks [0, 1, 2] on process set 0" in msg, msg
                assert "ranks [3] on process set 1 (ranks [2, 3])" in msg, msg
                continue
            assert "|   ranks 0-2: " in msg and "|   rank 3: " in msg and "HINT:" in msg, msg
    assert sorted(re.findall(r"^\[\d\] AFTER (\d+)$", proc.stdout, re.M)) == [str(RANKS)] * RANKS
    wait_for_only_sshd(cluster, within=10)


def test_skipped_allreduce_is_reported_then_the_job_exits_non_zero(
    cluster: tc.Cluster, tmp_path: Path
) -> None:
    warning_s, shutdown_s = 2.0, 5.0
    proc, ended = _ringtrain_run(
        cluster,
        tmp_path,
        STALL_SCRIPT,
        "--stall-warning-time",
        str(warning_s),
        "--stall-shutdown-time",
        str(shutdown_s),
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log
    assert "NOT-REACHED" not in proc.stdout, log
    starts = [float(t) for t in re.findall(r"^\[\d\] STALL-START ([\d.]+)$", proc.stdout, re.M)]
    assert len(starts) == RANKS, log
    stalled_at = max(starts)

    # Rank 0 (which watches the set) warns once the warning time has passed, naming rank 3 and
    # the tensor it skipped.
    warnings = re.findall(r"([\d.]+) WARNING stall: ", proc.stderr)
    assert warnings, log
    warned_after = float(warnings[0]) - stalled_at
    assert warning_s <= warned_after + 0.1 < warning_s + 2.0, f"warned after {warned_after:.2f} s"
    assert "rank 3 has not submitted: 'grad.skipped'" in proc.stderr, log
    assert "'grad.skipped' waiting" in proc.stderr and "submitted by ranks [0, 1, 2]" in log

    # After the shutdown time every rank stops with the report, and so does the job.
    for rank in range(RANKS):
        assert re.search(rf"^\[{rank}\].*StallError: stall: ", proc.stderr, re.M), log
    assert "ringtrain is stopping the job: the stall exceeded the shutdown time" in proc.stderr
    assert "ringtrain run: job failed: rank" in proc.stderr, log
    took = ended - stalled_at
    assert shutdown_s <= took < shutdown_s + 10, f"the job ended {took:.1f} s after the stall began"
    wait_for_only_sshd(cluster, within=10)


def test_a_rank_slow_in_compute_is_reported_as_compute_bound(
    cluster: tc.Cluster, tmp_path: Path
) -> None:
    proc, _ = _ringtrain_run(cluster, tmp_path, COMPUTE_SCRIPT, "--straggler-report-steps", "5")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    # Every rank holds the same verdict; rank 0 also logs it as one line.
    reports = re.findall(r"^\[\d\] REPORT (.*)$", proc.stdout, re.M)
    assert reports == ["compute [3] ['h1']"] * RANKS, log
    assert "ringtrain straggler report: rank 3 on host h1 is compute-bound" in proc.stderr, log
    wait_for_only_sshd(cluster, within=10)
