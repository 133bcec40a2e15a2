"""``ringtrain doctor`` end to end on this machine: the local check, an unreachable host, and the
link test over loopback. Nothing leaves loopback: the unreachable host is an ssh alias that an
ssh config file maps to 127.0.0.1 port 1, where nothing listens."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from ringtrain.doctor import gather, linktest, wire
from ringtrain.host.network import Interface
from ringtrain.launch.hosts import Host

# Runs the CLI in a fresh interpreter and says whether the doctor process imported torch.
RUN_CLI = textwrap.dedent(
    """
    import sys
    from ringtrain.cli import main
    code = main(sys.argv[1:])
    print("TORCH_IMPORTED", "torch" in sys.modules, file=sys.stderr)
    sys.exit(code)
    """
)


def _doctor(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUN_CLI, "doctor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_local_doctor_json(tmp_path: Path) -> None:
    proc = _doctor(
        "--json", "--model-params", "25e6", "--step-time", "0.2", "--allreduce-sizes", "64K,1M"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TORCH_IMPORTED False" in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and doc["exit_code"] == 0 and doc["problems"] == []
    (host,) = doc["hosts"]
    assert host["name"] == "localhost" and host["reachable"] and host["error"] is None
    facts = host["facts"]
    import torch  # the test may import torch; the doctor process did not

    assert facts["torch"]["version"] == torch.__version__
    # ATen's kernels, as this process picked them (same environment, same CPU).
    assert facts["torch"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert facts["torch"]["gloo"] is True
    assert facts["cpu"]["logical"] == psutil.cpu_count(logical=True)
    assert facts["cpu"]["usable"] >= 1 and isinstance(facts["cpu"]["hyperthreading"], bool)
    assert isinstance(facts["numa_nodes"], list) and "allocator" in facts
    assert "threads_env" in facts and facts["torch"]["num_threads"] >= 1
    assert any(i["is_loopback"] for i in facts["interfaces"])
    assert doc["links"]["skipped"] == "one host"
    ar = doc["allreduce"]
    assert ar["world"] == 2 and ar["hosts"] == ["localhost"]
    assert [p["bytes"] for p in ar["allreduce"]][:1] == [64 * 1024]
    assert all(p["busbw"] > 0 and p["iters"] >= 1 for p in ar["allreduce"])
    # Each size's timed ops repeat one name, so they all ride the fast lane (as a training
    # step's repeated collectives do), none negotiated.
    assert [p["on_lane"] for p in ar["allreduce"]] == [p["iters"] for p in ar["allreduce"]]
    # No -np and no hosts named: no job's placement is known, so none is claimed (it said
    # "Placement of -np 1" beside a 2-rank allreduce job).
    assert doc["placement"]["np"] is None and "no -np" in doc["placement"]["skipped"]
    compute = doc["compute"]  # every rank of the job timed its compute; one planned rank here
    assert ar["rank_hosts"] == ["localhost"] * 2 and len(ar["compute_gflops"]) == 2
    assert compute["host_gflops"]["localhost"] > 0 and compute["shares"] == [100]
    assert compute["gain"] == 1.0
    # Several probes per rank, the medians in compute_gflops (the spread: test_doctor_speed_noise).
    samples = ar["compute_samples"]
    assert len(samples) == 2 and all(len(s) == 5 and min(s) > 0 for s in samples)
    assert compute["probes"] == 5 and compute["host_range"]["localhost"][0] > 0
    pred = doc["prediction"]
    assert pred["world"] == 1 and pred["recommended"]["efficiency"] == 1.0


def test_unreachable_host_fails_with_sshs_error(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text(
        "Host nosuchhost.invalid\n"
        "    HostName 127.0.0.1\n"
        "    Port 1\n"
        "    BatchMode yes\n"
        "    ConnectTimeout 2\n"
    )
    args = ["-H", "nosuchhost.invalid:1", "--ssh-config-file", str(config)]
    proc = _doctor("--json", *args, "--ssh-connect-timeout", "2", timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    (host,) = doc["hosts"]
    assert host["reachable"] is False
    (problem,) = doc["problems"]
    assert "host nosuchhost.invalid is unreachable" in problem
    assert "port 1" in problem and "refused" in problem.lower()  # ssh's own words
    assert doc["allreduce"]["skipped"]
    # The table says the same to a person.
    human = _doctor(*args, "--ssh-connect-timeout", "2", timeout=60)
    assert human.returncode == 1
    assert "NOT READY" in human.stdout and "Connection refused" in human.stdout


def test_link_test_over_loopback() -> None:
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            wire.PROBE_MODULE,
            "--deadline",
            "30",
            "serve",
            "--bind",
            "127.0.0.1",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        (ready,) = wire.records([server.stdout.readline()])
        result = linktest.measure("127.0.0.1", ready["port"], seconds=0.2, rtts=5)
        assert "error" not in result, result
        assert result["bytes"] > 0 and result["bytes_per_s"] > 0
        assert 0 < result["rtt_min_s"] <= result["rtt_s"] < 1.0
        # A second sender is served too (one receiver serves a whole row of the matrix).
        again = linktest.measure("127.0.0.1", ready["port"], seconds=0.1, rtts=2)
        assert again["bytes_per_s"] > 0
    finally:
        assert server.stdin is not None
        server.stdin.close()  # the lifeline: the receiver exits
        assert server.wait(10) == 0


def test_link_test_to_a_closed_port_reports_the_error() -> None:
    result = linktest.measure("127.0.0.1", 1, seconds=0.1, rtts=1, timeout=2)
    assert "Connection refused" in result["error"]


@pytest.mark.timeout(60)
def test_link_matrix_between_two_local_names() -> None:
    # Both names are local to the launcher: the whole orchestration runs without ssh.
    hosts = [Host("localhost", 1), Host("127.0.0.1", 1)]
    lo = Interface("lo", "127.0.0.1", 8, True, True)
    samples, _ = gather.measure_links(hosts, {h.name: lo for h in hosts}, gather.Reach(), 0.2, 3)
    assert sorted((s.src, s.dst) for s in samples) == [
        ("127.0.0.1", "localhost"),
        ("localhost", "127.0.0.1"),
    ]
    assert all(s.error is None and (s.bytes_per_s or 0) > 0 and s.rtt_s for s in samples)
