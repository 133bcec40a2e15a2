"""The test cluster itself: ssh into each host, reachability, shaping, cleanup, discovery."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _only_sshd import wait_for_only_sshd
from ringtrain.host import network
from ringtrain.testing import cgroup_mount, netns
from ringtrain.testing import cluster as tc
from ringtrain.testing.cluster import DOCKER0, HostSpec

pytestmark = pytest.mark.cluster

# h1 has another interface name, every host an unrouted docker0 with the same address.
CLUSTER = [
    HostSpec(extra=(DOCKER0,)),
    HostSpec(interface="eth7", extra=(DOCKER0,)),
    HostSpec(),
]

PY = sys.executable


def _leftovers(c: tc.Cluster) -> list[str]:
    """Anything of ``c`` still on the machine."""
    left = [n for n in netns.netns_names() if netns.prefix_of(n) == c.prefix]
    left += [n for n in netns.link_names() if netns.prefix_of(n) == c.prefix]
    left += [str(d) for d in netns.etc_dirs() if netns.prefix_of(d.name) == c.prefix]
    if c.workdir.exists():
        left.append(str(c.workdir))
    return left


def test_ssh_into_every_host(cluster: tc.Cluster) -> None:
    for h in cluster.hosts:
        proc = cluster.ssh(h.name, ["sh", "-c", "hostname; ip -o -4 addr show"], timeout=30)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0] == h.name  # its own UTS namespace
        addrs = {(ln.split()[1], ln.split()[3]) for ln in lines[1:]}
        assert (h.interface, f"{h.address}/24") in addrs
        assert ("lo", "127.0.0.1/8") in addrs
        # Only this host's link: no other host's address, nothing of the root namespace.
        others = {o.address for o in cluster.hosts if o is not h} | {cluster.launcher_address}
        assert not any(a.split("/")[0] in others for _, a in addrs)


def test_host_keys_are_checked(cluster: tc.Cluster, tmp_path: Path) -> None:
    # The config pins the real host keys: a known_hosts with another key must be refused.
    bad = tmp_path / "known_hosts"
    lines = cluster.known_hosts_path.read_text().splitlines()
    bad.write_text("\n".join([lines[1].split()[0] + " " + " ".join(lines[0].split()[1:])]) + "\n")
    argv = cluster.ssh_argv("h1", ["true"])
    argv[1:1] = ["-o", f"UserKnownHostsFile={bad}"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 255
    assert "HOST IDENTIFICATION HAS CHANGED" in proc.stderr or "verification failed" in proc.stderr


def test_exec_runs_inside_the_host(cluster: tc.Cluster) -> None:
    h = cluster.hosts[1]
    proc = cluster.exec(h.name, ["sh", "-c", "hostname; ip -o link show"], check=True)
    assert proc.stdout.splitlines()[0] == h.name
    assert f": {h.interface}@" in proc.stdout and ": docker0:" in proc.stdout


def test_hosts_see_the_cgroup_cpu_controller(cluster: tc.Cluster) -> None:
    # ip netns exec's fresh /sys hides the machine's cgroups; each host mounts the cpu
    # controller again, so a rank can be given a CPU quota (bench mixed-speed --slow-by cgroup).
    if cgroup_mount.CGROUP_CPU == "true;":
        pytest.skip("this machine offers no cgroup cpu controller")
    check = "test -e /sys/fs/cgroup/cpu/cpu.cfs_quota_us || grep -qw cpu /sys/fs/cgroup/cgroup.controllers"
    assert cluster.ssh("h1", ["sh", "-c", check], timeout=30).returncode == 0


_CONNECT = textwrap.dedent(
    """
    import socket, sys
    try:
        with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as s:
            print("connected", s.recv(64).decode().strip() if sys.argv[3:] else "")
    except OSError as e:
        print("ERR", e.errno)
    """
)


def test_hosts_reach_each_other_and_the_launcher_only(cluster: tc.Cluster) -> None:
    h0, h1, h2 = cluster.hosts
    for src, dst in [(h0, h1), (h1, h2), (h2, h0)]:
        argv = [PY, "-c", _CONNECT, dst.address, str(cluster.port), "banner"]
        out = cluster.exec(src.name, argv).stdout
        assert out.startswith("connected SSH-2.0"), f"{src.name} -> {dst.name}: {out}"
    # The launcher's address (root namespace, on the bridge) is reachable: a listener there.
    import socket

    with socket.create_server((cluster.launcher_address, 0)) as srv:
        port = srv.getsockname()[1]
        out = cluster.exec(h1.name, [PY, "-c", _CONNECT, cluster.launcher_address, str(port)])
        conn, peer = srv.accept()
        conn.close()
    assert peer[0] == h1.address and out.stdout.startswith("connected")
    # No route leads anywhere else (ENETUNREACH = 101).
    out = cluster.exec(h0.name, [PY, "-c", _CONNECT, "192.0.2.1", "9"]).stdout
    assert out.strip() == "ERR 101"


def test_parallel_clusters_do_not_collide(cluster: tc.Cluster, make_cluster) -> None:
    other = make_cluster(1)
    assert other.subnet != cluster.subnet and other.prefix != cluster.prefix
    assert other.ssh("h0", ["hostname"]).stdout.strip() == "h0"
    # Two separate networks: the other cluster's h0 cannot reach this one's.
    out = other.exec("h0", [PY, "-c", _CONNECT, cluster.hosts[0].address, str(cluster.port)])
    assert out.stdout.strip() == "ERR 101"
    assert cluster.ssh("h0", ["true"]).returncode == 0


_RECEIVE = textwrap.dedent(
    """
    import socket, sys, time
    srv = socket.create_server((sys.argv[1], 0))
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    n, first = 0, None
    while True:
        b = conn.recv(1 << 16)
        if not b:
            break
        first = first or time.monotonic()
        n += len(b)
    print(n, time.monotonic() - first, flush=True)
    """
)
_SEND = textwrap.dedent(
    """
    import socket, sys, time
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    buf, end = b"x" * 65536, time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:
        s.sendall(buf)
    s.close()
    """
)


def _throughput(c: tc.Cluster, src: str, dst: str, seconds: float = 1.5) -> float:
    """Bytes per second a TCP stream moves from ``src`` to ``dst``, measured at ``dst``."""
    addr = c.host(dst).address
    rx = c.popen(dst, [PY, "-c", _RECEIVE, addr], stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout is not None
        port = rx.stdout.readline().strip()
        c.exec(src, [PY, "-c", _SEND, addr, port, str(seconds)], check=True, timeout=30)
        nbytes, elapsed = rx.stdout.readline().split()
        rx.wait(timeout=10)
    finally:
        rx.kill()
        rx.wait()
    return int(nbytes) / float(elapsed)


def test_shaping_limits_throughput_both_ways(make_cluster) -> None:
    rate = "10mbit"
    c = make_cluster([HostSpec(rate=rate), HostSpec()])
    shaped = tc.rate_bits(rate) / 8
    for src, dst in [("h0", "h1"), ("h1", "h0")]:
        got = _throughput(c, src, dst)
        assert 0.3 * shaped < got < 2 * shaped, f"{src}->{dst}: {got:.0f} B/s for {rate}"
    # Lifting the limit makes the same link much faster: the limit was the shaping.
    c.shape("h0", None)
    assert _throughput(c, "h0", "h1", seconds=0.5) > 4 * shaped


def test_down_leaves_nothing_behind(make_cluster) -> None:
    c = make_cluster(2)
    # A process started over ssh that would outlive its session.
    proc = c.ssh("h0", ["sh", "-c", "nohup sleep 300 >/dev/null 2>&1 & echo $!"])
    assert proc.returncode == 0, proc.stderr
    pids = c.pids("h0") + c.pids("h1")
    assert len(pids) >= 3  # two sshds and the sleep
    sshds = [c.sshd_pid(h.name) for h in c.hosts]
    c.down()
    assert _leftovers(c) == []
    time.sleep(0.1)
    alive = [p for p in pids if Path(f"/proc/{p}").exists() and _state(p) != "Z"]
    assert alive == [], f"still running: {alive} (sshds were {sshds})"
    c.down()  # twice is harmless


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_killed_runs_cluster_is_removed_by_the_next_one(make_cluster) -> None:
    script = textwrap.dedent(
        """
        import os, signal, sys
        from ringtrain.testing.cluster import Cluster
        c = Cluster(2).up()
        print(c.prefix, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no cleanup
        """
    )
    proc = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    prefix = proc.stdout.strip()
    assert netns.prefixes().get(prefix) is False  # there, and its owner is dead
    sshds = [
        int(p) for h in (0, 1) for p in netns.run(["ip", "netns", "pids", f"{prefix}h{h}"]).split()
    ]
    assert sshds
    make_cluster(1)  # up() clears stale clusters first
    assert prefix not in netns.prefixes()
    assert not Path(netns.workdir_of(prefix)).exists()
    time.sleep(0.1)
    assert [p for p in sshds if _state(p) not in ("gone", "Z")] == []


def test_command_line_up_status_down(cluster_tools: None) -> None:
    cli = [PY, "-m", "ringtrain.testing.cluster"]
    up = subprocess.run(
        [*cli, "up", "--hosts", "2", "--iface", "h1=eth7"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        assert up.returncode == 0, up.stderr
        assert "h1: " in up.stdout and "on eth7" in up.stdout
        config = up.stdout.split("ssh -F ", 1)[1].split()[0]
        ssh = subprocess.run(
            ["ssh", "-F", config, "h1", "hostname"], capture_output=True, text=True, timeout=30
        )
        assert ssh.stdout.strip() == "h1", ssh.stderr
        status = subprocess.run([*cli, "status"], capture_output=True, text=True, timeout=60)
        assert "rtpg" in status.stdout and "alive" in status.stdout
    finally:
        down = subprocess.run([*cli, "down"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and "removed rtpg" in down.stdout
    assert not [p for p in netns.prefixes() if p.startswith("rtpg")]


# ---- interface discovery on real namespaces --------------------------------------------------

_DISCOVER = (
    "import json; from ringtrain.host.network import local_interfaces; "
    "print(json.dumps([i.to_dict() for i in local_interfaces()]))"
)


def test_discovery_picks_each_hosts_own_name_and_ignores_docker0(cluster: tc.Cluster) -> None:
    reports = {}
    for h in cluster.hosts[:2]:
        proc = cluster.ssh(h.name, [PY, "-c", _DISCOVER], timeout=60)
        assert proc.returncode == 0, proc.stderr
        reports[h.name] = [network.Interface.from_dict(d) for d in json.loads(proc.stdout)]
    docker = [i for i in reports["h0"] if i.name == "docker0"]
    assert docker and {"bridge", "docker"} <= set(docker[0].flags) and docker[0].is_up
    chosen = network.choose(reports)
    assert {h: i.name for h, i in chosen.items()} == {"h0": "eth0", "h1": "eth7"}
    assert [i.address for i in chosen.values()] == [h.address for h in cluster.hosts[:2]]
    # The launcher (this process, root namespace) advertises its address on the bridge.
    addr, env = network.plan_network({h: [i.to_dict() for i in v] for h, v in reports.items()})
    assert addr == cluster.launcher_address
    assert env["h1"]["GLOO_SOCKET_IFNAME"] == "eth7"
    # The CIDR form finds the same interfaces.
    by_cidr = network.resolve_spec(cluster.subnet, reports)
    assert {h: i.name for h, i in by_cidr.items()} == {"h0": "eth0", "h1": "eth7"}


def test_cluster_is_fast_to_make(cluster_tools: None) -> None:
    t0 = time.monotonic()
    with tc.Cluster(3) as c:
        took = time.monotonic() - t0
        assert all(c.pids(h.name) for h in c.hosts)
    assert took < 10.0, f"3 hosts took {took:.1f} s"  # ~1 s on a quiet machine
    assert os.path.exists(c.workdir) is False


def test_ringtrain_run_reaches_hosts_with_different_interface_names(cluster: tc.Cluster) -> None:
    # The launcher runs here, in the root namespace; h1's interface is eth7 and every host has
    # an unrouted docker0: no network flags are needed.
    proc = subprocess.run(
        [PY, "-m", "ringtrain", "run", "-v", *cluster.launcher_args(), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ringtrain check OK: 3 rank(s)" in proc.stdout
    for h in cluster.hosts:
        assert f"rank {h.name[1:]}/3 on {h.name} " in proc.stdout  # each rank on its own host
    # Nothing of the job is left in any host: only its sshd.
    wait_for_only_sshd(cluster, within=10)
