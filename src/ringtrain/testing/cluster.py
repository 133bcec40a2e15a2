"""A multi-host test cluster on one machine: Linux network namespaces, a bridge, sshd in each.

Each fake host is a network namespace with one veth link to a bridge, an IPv4 address, its
own loopback, and an sshd on a non-default port (2222), so the launcher's real ssh path is
exercised, ports and aliases included::

    root namespace                          namespace <prefix>h0 (ssh alias h0)
      <prefix>br  198.18.K.1/24  --veth--    eth0   198.18.K.10/24   sshd :2222
                                 --veth--    eth7   198.18.K.11/24   (h1: its own iface name)
                                 --veth--    ...

Design: the bridge lives in the root namespace and has the address ``198.18.K.1``, so the test
process (and a launcher it starts) reaches every host directly: ``ssh -F cluster.ssh_config_path
h0`` works from the test process, and ranks reach a rendezvous served by the launcher at
``cluster.launcher_address``. No default route is added anywhere: hosts reach only their subnet,
and the root namespace only gains the connected route of that /24. K is 0 unless another cluster
already uses 198.18.0.0/24 (parallel test runs), then the next free /24 inside 198.18.0.0/16.

Every host also runs in its own UTS namespace (``unshare --uts``) with hostname ``h0``, ``h1``...,
so ``hostname`` over ssh, and :meth:`Cluster.exec`, say which host they are on. Inside the hosts,
``h0``... and ``launcher`` resolve through a per-namespace ``/etc/hosts`` (``/etc/netns/<ns>/``,
which ``ip netns exec`` mounts), and nothing asks a DNS server. Each host mounts the cgroup
``cpu`` controller that ``ip netns exec``'s fresh ``/sys`` hides
(:mod:`~ringtrain.testing.cgroup_mount`): a rank can have a CPU quota, as on a smaller host.

Security: sshd runs as root with a private config (keys in the cluster's temporary directory,
``PermitRootLogin prohibit-password``, public keys only, no PAM). A fresh ed25519 client key and
fresh host keys are made per cluster; the ssh config pins the hosts' real keys in its own
``known_hosts``, so ``StrictHostKeyChecking`` stays on.

Extras per host (:class:`HostSpec`): another interface name, extra interfaces that are not
routed between hosts (a ``docker0`` bridge with 172.17.0.1/16 on every host, the classic trap),
and ``tc tbf`` shaping of the link in both directions. There is no delay: this kernel lacks
``netem``; tbf's ``latency`` only bounds its queue.

Cleanup: :meth:`Cluster.down` kills every process in the hosts' namespaces, deletes the
namespaces (their veths go with them), the bridge, ``/etc/netns/<ns>`` and the temporary
directory (see :mod:`ringtrain.testing.netns`). It runs on
leaving the context manager, at interpreter exit, and, for a run that was killed, at the next
:meth:`Cluster.up` (names carry the owner's pid; those of dead owners are removed).

Needs root, iproute2 (``ip``, ``tc``), util-linux (``unshare``) and OpenSSH (``sshd``, ``ssh``).

As a script::

    python -m ringtrain.testing.cluster up --hosts 3 [--iface h1=eth7] [--rate h0=10mbit] [--docker0]
    python -m ringtrain.testing.cluster status
    python -m ringtrain.testing.cluster down
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import pwd
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ringtrain.testing import cgroup_mount
from ringtrain.testing.netns import (
    ETC_NETNS,
    NAME,
    SUBNET_BASE,
    ClusterError,
    global_lock,
    missing_tools,
    prefixes,
    remove,
    remove_stale,
    run,
    sshd_path,
    used_subnets,
    workdir_of,
)

SSH_PORT = 2222
FIRST_HOST_OCTET = 10
MAX_HOSTS = 200
_RATE = re.compile(r"^(?P<num>\d+(?:\.\d+)?)(?P<unit>[kmgt]?)(?P<kind>bit|bps)?$", re.I)
# This process's clusters that are not down yet, by number.
_live: set[int] = set()


@dataclass(frozen=True)
class ExtraInterface:
    """An interface that exists on a host but is not routed between hosts."""

    name: str
    cidr: str  # the interface's own address, e.g. "172.17.0.1/16"
    # "bridge": a bridge with one port, so it is up and running like a docker0 with containers;
    # "veth": a plain link end (its unaddressed peer stays in the host). This kernel has no
    # dummy or macvlan devices.
    kind: str = "bridge"


DOCKER0 = ExtraInterface("docker0", "172.17.0.1/16")


@dataclass(frozen=True)
class HostSpec:
    """How one fake host looks. The defaults give a plain host with ``eth0``."""

    interface: str = "eth0"
    rate: str | None = None  # tc rate of the host's link, both directions: "10mbit", "1gbit"
    burst: str | None = None  # tbf bucket; default: 10 ms at the rate, at least 16 KiB
    latency: str | None = None  # tbf queue bound (not a delay); default 50ms
    extra: tuple[ExtraInterface, ...] = ()


@dataclass(frozen=True)
class ClusterHost:
    name: str  # the ssh alias, also the host's hostname
    address: str
    interface: str
    netns: str
    spec: HostSpec = field(default_factory=HostSpec)


def rate_bits(rate: str) -> float:
    """A tc rate (``10mbit``, ``1gbit``, ``500kbit``, ``2mbps`` = bytes/s) in bits per second."""
    m = _RATE.match(rate.strip())
    if not m:
        raise ValueError(f"cannot parse rate {rate!r}; expected e.g. 10mbit, 1gbit, 500kbit")
    value = float(m["num"]) * 1000 ** " kmgt".index(m["unit"].lower() or " ")
    return value * 8 if (m["kind"] or "bit").lower() == "bps" else value


class Cluster:
    """N fake hosts reachable over ssh. Use as a context manager, or call up() and down()."""

    def __init__(
        self,
        hosts: int | Sequence[HostSpec] = 3,
        *,
        port: int = SSH_PORT,
        persistent: bool = False,
    ) -> None:
        specs = [HostSpec()] * hosts if isinstance(hosts, int) else list(hosts)
        if not 1 <= len(specs) <= MAX_HOSTS:
            raise ValueError(f"a cluster has 1..{MAX_HOSTS} hosts, got {len(specs)}")
        for s in specs:
            if not 1 <= len(s.interface) <= 15 or "/" in s.interface or " " in s.interface:
                raise ValueError(f"bad interface name {s.interface!r} (1-15 chars, no / or space)")
        self.specs = specs
        self.port = port
        self.persistent = persistent
        self._n = 0
        if persistent:
            used = {int(NAME.match(p + "br")["n"]) for p in prefixes() if p.startswith("rtpg")}  # type: ignore[index]
            self.prefix = f"rtpg{min(set(range(len(used) + 1)) - used)}"
        else:
            # Numbers are reused once a cluster is down, so names stay within 15 characters.
            n = min(set(range(1, len(_live) + 2)) - _live)
            _live.add(n)
            self.prefix = f"rt{os.getpid():x}g{n}"
            self._n = n
        self.workdir = workdir_of(self.prefix)
        self.ssh_config_path = self.workdir / "ssh_config"
        self.identity_file = self.workdir / "id_ed25519"
        self.known_hosts_path = self.workdir / "known_hosts"
        self.bridge = f"{self.prefix}br"
        self.subnet = ""
        self.launcher_address = ""
        self.hosts: list[ClusterHost] = []
        self._sshd: dict[str, subprocess.Popen[bytes]] = {}
        self._up = False

    # ---- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> Cluster:
        """Create the hosts and start sshd on each. On any failure, removes what it made."""
        if os.geteuid() != 0:
            raise ClusterError("the test cluster needs root (network namespaces, sshd)")
        missing = missing_tools()
        if missing:
            raise ClusterError(f"missing tools: {', '.join(missing)} (install iproute2, openssh)")
        if not self.persistent:
            atexit.register(self.down)
        try:
            with global_lock():
                remove_stale()
                # Ours by name, yet not made by this object: left by a killed process whose pid
                # this one reuses.
                remove(self.prefix)
                free = sorted(set(range(256)) - used_subnets())
                if not free:
                    raise ClusterError(f"no free /24 left in {SUBNET_BASE}.0.0/16")
                k = free[0]
                self.subnet = f"{SUBNET_BASE}.{k}.0/24"
                self.launcher_address = f"{SUBNET_BASE}.{k}.1"
                self.hosts = [
                    ClusterHost(
                        f"h{i}",
                        f"{SUBNET_BASE}.{k}.{FIRST_HOST_OCTET + i}",
                        s.interface,
                        f"{self.prefix}h{i}",
                        s,
                    )
                    for i, s in enumerate(self.specs)
                ]
                self.workdir.mkdir(mode=0o700)
                self._up = True
                self._make_network()
                self._write_etc()  # under the lock: remove() may delete an empty /etc/netns
            self._write_ssh_files()
            self._start_sshds()
            self._write_state()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove every process, namespace, link and file of this cluster. Safe to call twice."""
        _live.discard(self._n)
        if not self._up:
            return
        self._up = False
        with contextlib.suppress(Exception):
            atexit.unregister(self.down)
        for proc in self._sshd.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        with global_lock():
            remove(self.prefix)
        for proc in self._sshd.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._sshd.clear()

    # ---- building ----------------------------------------------------------------------------

    def _make_network(self) -> None:
        prefixlen = 24
        root = [f"link add {self.bridge} type bridge forward_delay 0"]
        for i, h in enumerate(self.hosts):
            root.append(f"netns add {h.netns}")
            root.append(
                f"link add {self.prefix}v{i} type veth peer name {h.interface} netns {h.netns}"
            )
            root.append(f"link set {self.prefix}v{i} master {self.bridge} up")
        root += [
            f"addr add {self.launcher_address}/{prefixlen} dev {self.bridge}",
            f"link set {self.bridge} up",
        ]
        run(["ip", "-batch", "-"], input="\n".join(root) + "\n")
        for h in self.hosts:
            cmds = [
                "link set lo up",
                f"addr add {h.address}/{prefixlen} dev {h.interface}",
                f"link set {h.interface} up",
            ]
            for j, x in enumerate(h.spec.extra):
                if x.kind == "bridge":
                    cmds += [
                        f"link add {x.name} type bridge forward_delay 0",
                        f"link add rtport{j} type veth peer name rtpeer{j}",
                        f"link set rtport{j} master {x.name} up",
                        f"link set rtpeer{j} up",
                    ]
                elif x.kind == "veth":
                    cmds += [
                        f"link add {x.name} type veth peer name rtpeer{j}",
                        f"link set rtpeer{j} up",
                    ]
                else:
                    raise ClusterError(f"extra interface kind must be bridge or veth: {x}")
                cmds += [f"addr add {x.cidr} dev {x.name}", f"link set {x.name} up"]
            run(["ip", "-n", h.netns, "-batch", "-"], input="\n".join(cmds) + "\n")
            if h.spec.rate:
                self.shape(h.name, h.spec.rate, burst=h.spec.burst, latency=h.spec.latency)

    def shape(
        self, host: str, rate: str | None, *, burst: str | None = None, latency: str | None = None
    ) -> None:
        """Limit ``host``'s link to ``rate`` in both directions (tc tbf); None removes it."""
        h = self.host(host)
        i = self.hosts.index(h)
        ends = [(["-n", h.netns], h.interface), ([], f"{self.prefix}v{i}")]
        for ns, dev in ends:
            if rate is None:
                run(["tc", *ns, "qdisc", "del", "dev", dev, "root"], check=False)
                continue
            bits = rate_bits(rate)
            b = burst or str(max(16384, int(bits / 8 / 100)))
            tbf = ["tbf", "rate", rate, "burst", b, "latency", latency or "50ms"]
            run(["tc", *ns, "qdisc", "replace", "dev", dev, "root", *tbf])

    def _write_ssh_files(self) -> None:
        client = Ed25519PrivateKey.generate()
        _write(
            self.identity_file,
            client.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            ),
            0o600,
        )
        pub = client.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        _write(self.workdir / "authorized_keys", pub + b" ringtrain-test-cluster\n", 0o600)
        known = []
        for h in self.hosts:
            hdir = self.workdir / h.name
            hdir.mkdir(mode=0o700)
            key = Ed25519PrivateKey.generate()
            _write(
                hdir / "ssh_host_ed25519_key",
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.OpenSSH,
                    serialization.NoEncryption(),
                ),
                0o600,
            )
            hpub = key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
            known.append(f"[{h.address}]:{self.port} {hpub.decode()}")
            _write(hdir / "sshd_config", self._sshd_config(h).encode(), 0o600)
        _write(self.known_hosts_path, ("\n".join(known) + "\n").encode(), 0o644)
        lines = []
        for h in self.hosts:
            lines += [f"Host {h.name}", f"    HostName {h.address}", ""]
        lines += [
            "Host *",
            f"    Port {self.port}",
            f"    User {pwd.getpwuid(os.getuid()).pw_name}",  # sshd logs in the uid, not $USER
            f"    IdentityFile {self.identity_file}",
            "    IdentitiesOnly yes",
            f"    UserKnownHostsFile {self.known_hosts_path}",
            "    GlobalKnownHostsFile /dev/null",
            "    StrictHostKeyChecking yes",
            "    BatchMode yes",
            "    ConnectTimeout 5",
            "    LogLevel ERROR",
            "",
        ]
        _write(self.ssh_config_path, "\n".join(lines).encode(), 0o644)

    def _write_etc(self) -> None:
        # Names resolve inside the hosts (h0, h1, ..., and "launcher" for the root namespace's
        # address) and nothing asks a DNS server the hosts cannot reach.
        hosts = ["127.0.0.1 localhost", f"{self.launcher_address} launcher"]
        hosts += [f"{h.address} {h.name}" for h in self.hosts]
        # Names come from that file only: an unreachable DNS makes every reverse lookup fail
        # with EAI_AGAIN (torch's c10d warns on each) instead of falling back to numbers.
        try:
            base = Path("/etc/nsswitch.conf").read_text().splitlines()
        except OSError:
            base = []
        nsswitch = "\n".join(
            [ln for ln in base if not ln.startswith("hosts:")] + ["hosts: files", ""]
        )
        for h in self.hosts:
            d = ETC_NETNS / h.netns
            d.mkdir(parents=True, exist_ok=True)
            _write(d / "hosts", ("\n".join(hosts) + "\n").encode(), 0o644)
            _write(d / "resolv.conf", b"# ringtrain test cluster: no DNS\n", 0o644)
            _write(d / "nsswitch.conf", nsswitch.encode(), 0o644)

    def _sshd_config(self, h: ClusterHost) -> str:
        hdir = self.workdir / h.name
        return "\n".join(
            [
                f"Port {self.port}",
                f"ListenAddress {h.address}",
                f"HostKey {hdir / 'ssh_host_ed25519_key'}",
                f"PidFile {hdir / 'sshd.pid'}",
                f"AuthorizedKeysFile {self.workdir / 'authorized_keys'}",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "UseDNS no",
                "PrintMotd no",
                # Tests open many sessions at once; the default (10:30:100) drops some.
                "MaxStartups 200",
                "MaxSessions 200",
                "LogLevel ERROR",
                "",
            ]
        )

    def _start_sshds(self) -> None:
        # sshd insists on its privilege-separation directory, as its system unit creates it.
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        sshd = sshd_path()
        assert sshd is not None
        for h in self.hosts:
            cfg = self.workdir / h.name / "sshd_config"
            log = open(self.workdir / h.name / "sshd.log", "ab")  # noqa: SIM115 - child owns it
            try:
                self._sshd[h.name] = subprocess.Popen(
                    self._in_host(h, [sshd, "-D", "-e", "-f", str(cfg)]),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            finally:
                log.close()
        deadline = time.monotonic() + 10
        pending = list(self.hosts)
        while pending:
            h = pending[0]
            proc = self._sshd[h.name]
            if proc.poll() is not None:
                log_text = (self.workdir / h.name / "sshd.log").read_text().strip()
                raise ClusterError(f"sshd on {h.name} exited with {proc.returncode}: {log_text}")
            try:
                with socket.create_connection((h.address, self.port), timeout=0.5):
                    pending.pop(0)
                    continue
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"sshd on {h.name} ({h.address}:{self.port}) did not start")
            time.sleep(0.02)

    def _write_state(self) -> None:
        state = {
            "prefix": self.prefix,
            "owner_pid": None if self.persistent else os.getpid(),
            "subnet": self.subnet,
            "launcher_address": self.launcher_address,
            "port": self.port,
            "ssh_config": str(self.ssh_config_path),
            "hosts": [asdict(h) for h in self.hosts],
            "sshd_pids": {n: p.pid for n, p in self._sshd.items()},
        }
        _write(self.workdir / "state.json", json.dumps(state, indent=2).encode(), 0o644)

    # ---- using -------------------------------------------------------------------------------

    def host(self, name: str) -> ClusterHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in this cluster; hosts: {[h.name for h in self.hosts]}")

    def _in_host(self, h: ClusterHost, argv: Sequence[str]) -> list[str]:
        # A fresh UTS namespace per command, named like the host: `hostname` says where it runs.
        enter = ["ip", "netns", "exec", h.netns, "unshare", "--uts", "--"]
        script = f'hostname "$0" && {{ {cgroup_mount.CGROUP_CPU} }} ; exec "$@"'
        return [*enter, "sh", "-c", script, h.name, *argv]

    def exec(
        self,
        host: str,
        argv: Sequence[str],
        *,
        timeout: float = 60,
        check: bool = False,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``host`` (its network and a UTS namespace named like it)."""
        return subprocess.run(
            self._in_host(self.host(host), argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            input=input,
            env=None if env is None else dict(env),
        )

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host`` without waiting; the caller waits or kills it."""
        return subprocess.Popen(self._in_host(self.host(host), argv), **kwargs)

    def ssh_argv(self, host: str, argv: Sequence[str] = ()) -> list[str]:
        """The argv that runs ``argv`` on ``host`` over ssh, as a launcher would."""
        return ["ssh", "-F", str(self.ssh_config_path), host, *([shlex.join(argv)] if argv else [])]

    def ssh(
        self, host: str, argv: Sequence[str], *, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.ssh_argv(host, argv), capture_output=True, text=True, timeout=timeout
        )

    def pids(self, host: str) -> list[int]:
        """Processes inside ``host``'s network namespace, its sshd included."""
        out = run(["ip", "netns", "pids", self.host(host).netns], check=False)
        return [int(p) for p in out.split()]

    def sshd_pid(self, host: str) -> int:
        return self._sshd[host].pid

    def hostfile_spec(self, slots: int = 1) -> str:
        """``-H h0:S,h1:S,...`` for the launcher."""
        return ",".join(f"{h.name}:{slots}" for h in self.hosts)

    def launcher_args(self, slots: int = 1) -> list[str]:
        """The ``ringtrain run`` flags that put a job on every host: ssh config and ``-H``."""
        return ["--ssh-config-file", str(self.ssh_config_path), "-H", self.hostfile_spec(slots)]


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


# ---- command line ------------------------------------------------------------------------------


def _per_host(items: Sequence[str], what: str) -> dict[int, str]:
    out = {}
    for item in items:
        host, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"h\d+", host) or not value:
            raise SystemExit(f"--{what} {item!r}: expected hN=VALUE, e.g. h1=eth7")
        out[int(host[1:])] = value
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringtrain.testing.cluster", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create a cluster that stays until `down`")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--port", type=int, default=SSH_PORT)
    up.add_argument("--iface", action="append", default=[], help="hN=NAME (repeatable)")
    up.add_argument("--rate", action="append", default=[], help="hN=RATE, e.g. h0=10mbit")
    up.add_argument("--docker0", action="store_true", help="add an unrouted docker0 to every host")
    down = sub.add_parser("down", help="remove clusters made by `up` (and stale ones)")
    down.add_argument("--prefix", help="only this cluster")
    sub.add_parser("status", help="list the clusters on this machine")
    args = p.parse_args(argv)
    if args.cmd == "up":
        ifaces, rates = _per_host(args.iface, "iface"), _per_host(args.rate, "rate")
        specs = [
            HostSpec(
                interface=ifaces.get(i, "eth0"),
                rate=rates.get(i),
                extra=(DOCKER0,) if args.docker0 else (),
            )
            for i in range(args.hosts)
        ]
        c = Cluster(specs, port=args.port, persistent=True).up()
        print(f"cluster {c.prefix}: {c.subnet}, launcher address {c.launcher_address}")
        for h in c.hosts:
            print(f"  {h.name}: {h.address} on {h.interface} (netns {h.netns})")
        print(f"ssh -F {c.ssh_config_path} h0 hostname")
        print(f"ringtrain run {' '.join(c.launcher_args())} ...")
        return 0
    if args.cmd == "down":
        targets = [args.prefix] if args.prefix else [p for p in prefixes() if p.startswith("rtpg")]
        with global_lock():
            for prefix in targets:
                remove(prefix)
                print(f"removed {prefix}")
            for prefix in remove_stale():
                print(f"removed stale {prefix}")
        return 0
    for prefix, alive in prefixes().items():
        state_file = workdir_of(prefix) / "state.json"
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
        hosts = ", ".join(f"{h['name']}={h['address']}" for h in state.get("hosts", []))
        print(f"{prefix}: {'alive' if alive else 'stale'} {state.get('subnet', '?')} {hosts}")
        if state:
            print(f"  ssh -F {state['ssh_config']} h0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
