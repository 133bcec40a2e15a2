"""A throwaway Slurm on this machine, for tests that start jobs with a real ``srun``.

Debian's ``slurm-wlm`` daemons (``slurmctld``, ``slurmd``) and ``munged``, each with files in one
temporary directory: a fresh munge key and socket, a generated ``slurm.conf`` on free ports,
state, spool and logs. Nothing under /etc is read or written and no system service is started;
jobs see the cluster through ``SLURM_CONF`` (:meth:`MiniSlurm.env`).

Nodes: this machine as one node (named by its hostname, on 127.0.0.1), or, given a namespace
test cluster (:mod:`ringtrain.testing.cluster`), one ``slurmd`` inside each of its hosts (node
names ``h0``, ``h1``...) and the controller on the cluster's bridge address. ``srun`` then runs
inside a host (:meth:`MiniSlurm.srun_argv` with ``cluster.popen``), as on a login node.

The daemons run as root (``SlurmUser=root``) with no cgroups (``proctrack/linuxproc``,
``task/none``) and no accounting. :meth:`MiniSlurm.down` stops every daemon it started, by its
process, and removes the directory; it runs on leaving the context manager.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ringtrain import environ
from ringtrain.environ import Slurm
from ringtrain.testing.cluster import Cluster

TOOLS = ("munged", "slurmctld", "slurmd", "srun", "sinfo", "squeue")


class SlurmError(RuntimeError):
    pass


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MiniSlurm:
    """Slurm with ``cpus`` CPUs per node. Use as a context manager, or call up() and down()."""

    def __init__(self, cluster: Cluster | None = None, cpus: int = 4) -> None:
        self.cluster = cluster
        self.cpus = cpus
        self.dir = Path()
        self.conf = Path()
        self._procs: list[subprocess.Popen[bytes]] = []
        if cluster is None:
            self.controller = (socket.gethostname(), "127.0.0.1")
            self.nodes = [(socket.gethostname(), "127.0.0.1")]
        else:
            self.controller = (socket.gethostname(), cluster.launcher_address)
            self.nodes = [(h.name, h.address) for h in cluster.hosts]

    def __enter__(self) -> MiniSlurm:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def env(self) -> dict[str, str]:
        """What a process needs to use this Slurm (``srun``, ``sinfo``)."""
        return {Slurm.CONF: str(self.conf)}

    def up(self) -> MiniSlurm:
        missing = missing_tools()
        if missing:
            raise SlurmError(
                f"missing {', '.join(missing)} (Debian: slurmctld slurmd slurm-client munge)"
            )
        self.dir = Path(tempfile.mkdtemp(prefix="ringtrain-slurm-"))
        # munged wants the path to its socket searchable by everyone.
        self.dir.chmod(0o755)
        try:
            self._start()
        except BaseException:
            self.down()
            raise
        return self

    def _start(self) -> None:
        d = self.dir
        for sub in ("state", "log"):
            (d / sub).mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn(
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={d / 'munge.sock'}",
                f"--pid-file={d / 'munged.pid'}",
                f"--log-file={d / 'log/munged.log'}",
                f"--seed-file={d / 'munged.seed'}",
            ],
            "munged",
        )
        self._wait(lambda: (d / "munge.sock").exists(), "munged did not create its socket")
        self.conf = d / "slurm.conf"
        self.conf.write_text(self._config(_free_port(), _free_port()))
        (d / "plugstack.conf").write_text("")
        if self.cluster is not None:
            # `ip netns exec` mounts a fresh /sys without cgroups, and this slurmd (22.05) cannot
            # run without a cgroup plugin: it reads the hierarchies through PID 1's root. It
            # creates nothing there (proctrack/linuxproc, task/none).
            (d / "cgroup.conf").write_text(
                "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/proc/1/root/sys/fs/cgroup\n"
            )
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for name, _ in self.nodes:
            (d / "spool" / name).mkdir(parents=True)
            argv = ["slurmd", "-D", "-f", str(self.conf), "-N", name]
            if self.cluster is None:
                self._spawn(argv, f"slurmd-{name}")
            else:
                self._spawn(argv, f"slurmd-{name}", host=name)
        self._wait(self._all_idle, "the Slurm nodes did not come up idle", timeout=60)

    def _config(self, ctld_port: int, slurmd_port: int) -> str:
        d = self.dir
        host, addr = self.controller
        lines = [
            "ClusterName=ringtraintest",
            f"SlurmctldHost={host}({addr})",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={d / 'munge.sock'}",
            "CredType=cred/munge",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'spool'}/%n/slurmd.pid",
            f"SlurmctldLogFile={d / 'log/slurmctld.log'}",
            f"SlurmdLogFile={d / 'log'}/slurmd-%n.log",
            f"PlugStackConfig={d / 'plugstack.conf'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "ReturnToService=2",
            # The CPUs below are declared, not counted: tests may ask for more than this machine has.
            "SlurmdParameters=config_overrides",
        ]
        lines += [
            f"NodeName={name} NodeAddr={node_addr} CPUs={self.cpus} State=UNKNOWN"
            for name, node_addr in self.nodes
        ]
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _spawn(self, argv: list[str], name: str, host: str | None = None) -> None:
        log = open(self.dir / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the child owns it
        try:
            kwargs: dict[str, Any] = {
                "stdin": subprocess.DEVNULL,
                "stdout": log,
                "stderr": log,
                "start_new_session": True,
                "env": {**environ.current(), **self.env()} if self.conf != Path() else None,
            }
            if host is None:
                proc = subprocess.Popen(argv, **kwargs)
            else:
                assert self.cluster is not None
                proc = self.cluster.popen(host, argv, **kwargs)
        finally:
            log.close()
        self._procs.append(proc)

    def _all_idle(self) -> bool:
        for p in self._procs:
            if p.poll() is not None:
                raise SlurmError(f"{p.args!r} exited with {p.returncode}:\n{self.logs()}")
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"],
            capture_output=True,
            text=True,
            env={**environ.current(), **self.env()},
            timeout=30,
        )
        states = dict(ln.split() for ln in out.stdout.splitlines() if len(ln.split()) == 2)
        return out.returncode == 0 and all(states.get(n) == "idle" for n, _ in self.nodes)

    def _wait(self, ready: Any, what: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise SlurmError(f"{what} within {timeout:.0f} s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        parts = []
        for f in sorted((self.dir / "log").glob("*")):
            tail = f.read_text(errors="replace").strip().splitlines()[-8:]
            parts.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def srun_argv(self, *args: str) -> list[str]:
        """``srun`` with this cluster's configuration, for a process that lacks :meth:`env`."""
        return ["env", f"SLURM_CONF={self.conf}", "srun", *args]

    def _no_jobs(self) -> bool:
        out = subprocess.run(
            ["squeue", "-h"],
            capture_output=True,
            text=True,
            env={**environ.current(), **self.env()},
            timeout=30,
        )
        return out.returncode != 0 or not out.stdout.strip()

    def down(self) -> None:
        if self._procs and self.conf != Path():  # let finished steps wind down first
            with contextlib.suppress(SlurmError, subprocess.TimeoutExpired, OSError):
                self._wait(self._no_jobs, "jobs still listed", timeout=15)
        for p in reversed(self._procs):  # the slurmds, then the controller, then munged
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs.clear()
        if self.dir != Path() and self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)
