"""What a test cluster leaves on the machine, and how it is found and removed.

Every object of a cluster carries its name prefix ``rt<owner>g<n>``: ``owner`` is the creating
process's pid in hex (or ``p`` for clusters made by the command line, which outlive it), so a
later run can tell a live cluster from one whose test run was killed. The parts: ``<prefix>br``
the bridge, ``<prefix>v<i>`` the root-side veths, ``<prefix>h<i>`` the namespaces, plus
``/etc/netns/<prefix>h<i>/`` and the temporary directory ``ringtrain-cluster-<prefix>``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

# Interface names are at most 15 characters: rt + 6 hex digits + g + n + v + i fits.
NAME = re.compile(r"^rt(?P<owner>p|[0-9a-f]+)g(?P<n>\d+)(?P<part>br|v\d+|h\d+)$")
WORKDIR_PREFIX = "ringtrain-cluster-"
# `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*: each host's hosts file and so on.
ETC_NETNS = Path("/etc/netns")
SUBNET_BASE = "198.18"


class ClusterError(RuntimeError):
    """The test cluster could not be created; the message says which step failed."""


def run(argv: Sequence[str], *, input: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        where = f" (input:\n{input})" if input else ""
        raise ClusterError(f"{shlex.join(argv)} failed: {proc.stderr.strip()}{where}")
    return proc.stdout


def missing_tools() -> list[str]:
    """The programs the cluster needs that are not installed."""
    tools = ["ip", "tc", "unshare", "hostname", "ssh"]
    missing = [t for t in tools if shutil.which(t) is None]
    if sshd_path() is None:
        missing.append("sshd")
    return missing


def sshd_path() -> str | None:
    return shutil.which("sshd") or next(
        (p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.access(p, os.X_OK)), None
    )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def global_lock() -> Iterator[None]:
    """Serialise cluster creation and cleanup between processes (picking a free subnet)."""
    with open(Path(tempfile.gettempdir()) / "ringtrain-cluster.lock", "a+") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN)


def netns_names() -> list[str]:
    out = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def link_names() -> list[str]:
    out = run(["ip", "-o", "link", "show"], check=False)
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def prefix_of(name: str) -> str | None:
    m = NAME.match(name)
    return f"rt{m['owner']}g{m['n']}" if m else None


def workdir_of(prefix: str) -> Path:
    return Path(tempfile.gettempdir()) / f"{WORKDIR_PREFIX}{prefix}"


def remove(prefix: str) -> None:
    """Remove everything of the cluster with this prefix. Call it holding :func:`global_lock`."""
    namespaces = [n for n in netns_names() if prefix_of(n) == prefix]
    for ns in namespaces:
        # Namespaced processes keep a deleted namespace alive, so end them first.
        for pid in run(["ip", "netns", "pids", ns], check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    workdir = workdir_of(prefix)
    kill_sshds(workdir)
    for ns in namespaces:
        run(["ip", "netns", "delete", ns], check=False)
    for link in link_names():
        if prefix_of(link) == prefix:
            run(["ip", "link", "delete", link], check=False)
    for d in etc_dirs():
        if prefix_of(d.name) == prefix:
            shutil.rmtree(d, ignore_errors=True)
    with contextlib.suppress(OSError):
        ETC_NETNS.rmdir()  # only when empty: other tools may keep files there
    shutil.rmtree(workdir, ignore_errors=True)


def etc_dirs() -> list[Path]:
    return sorted(ETC_NETNS.glob("rt*")) if ETC_NETNS.is_dir() else []


def kill_sshds(workdir: Path) -> None:
    # An sshd whose namespace is already gone is found by its config path.
    marker = str(workdir) + "/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "sshd" in cmdline and marker in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


def prefixes() -> dict[str, bool]:
    """Every cluster prefix on this machine, mapped to whether its owner is still alive."""
    found: set[str] = set()
    for name in [*netns_names(), *link_names(), *(d.name for d in etc_dirs())]:
        p = prefix_of(name)
        if p:
            found.add(p)
    for d in Path(tempfile.gettempdir()).glob(WORKDIR_PREFIX + "rt*"):
        p = d.name[len(WORKDIR_PREFIX) :]
        if NAME.match(p + "br"):
            found.add(p)
    out = {}
    for p in sorted(found):
        owner = NAME.match(p + "br")["owner"]  # type: ignore[index]
        out[p] = owner == "p" or pid_alive(int(owner, 16))
    return out


def remove_stale() -> list[str]:
    """Remove clusters whose owning process is gone (a killed test run). Returns their prefixes."""
    stale = [p for p, alive in prefixes().items() if not alive]
    for p in stale:
        remove(p)
    return stale


def used_subnets() -> set[int]:
    used = set()
    out = run(["ip", "-o", "-4", "addr", "show"], check=False)
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 3 and prefix_of(parts[1]) and parts[3].startswith(SUBNET_BASE + "."):
            used.add(int(parts[3].split(".")[2]))
    return used
