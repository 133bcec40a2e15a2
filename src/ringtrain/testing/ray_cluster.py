"""A real Ray cluster on the namespace test cluster: ``ray start --head`` in one fake host,
``ray start --address`` in the others, token authentication on.

    with tc.Cluster(2) as c, RayCluster(c) as ray_c:
        out = ray_c.run_driver("h0", [sys.executable, "job.py"])   # ray.init() inside finds it

Each host is its own network namespace, so every port Ray binds (GCS, raylet, object manager,
workers) is reachable only on that host's 198.18.x.x address and its loopback. Nodes advertise
their namespace address (``--node-ip-address``); nothing asks a route to the internet.

Token authentication: one random token per cluster, in a file only root can read
(``RAY_AUTH_TOKEN_PATH``), with ``RAY_AUTH_MODE=token`` for the head, the joiners and the driver
(:attr:`env`). Ray's dashboard and usage statistics are off and each node gets an explicit CPU
count, a small object store and its own ``--temp-dir`` (the hosts share one filesystem).

Stopping: ``ray stop --force`` is NOT used: it matches processes by name in the whole machine
(the namespaces share one process table), so it would also kill other Ray clusters running here.
:meth:`stop` kills the processes of each host's network namespace instead (sshd excepted) and
checks that no ``raylet`` or ``gcs_server`` is left in them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ringtrain import environ
from ringtrain.environ import Process, Ray, Threads
from ringtrain.testing.cluster import Cluster

RAY_PORT = 6379
OBJECT_STORE_BYTES = 80 * 1024 * 1024
# Ray's own daemons: none may outlive the cluster.
DAEMONS = ("raylet", "gcs_server")


class RayClusterError(RuntimeError):
    pass


class RayCluster:
    """Ray on the hosts of ``cluster``: the head on ``head``, one joining node per other host."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        hosts: Sequence[str] | None = None,
        num_cpus: int = 2,
        timeout_s: float = 120.0,
    ) -> None:
        self.cluster = cluster
        self.hosts = list(hosts or [h.name for h in cluster.hosts])
        self.head = self.hosts[0]
        self.num_cpus = num_cpus
        self.timeout_s = timeout_s
        self.address = f"{cluster.host(self.head).address}:{RAY_PORT}"
        self.token_path = cluster.workdir / "ray_auth_token"
        self._started: list[str] = []
        bindir = Path(sys.executable).parent
        self.ray_bin = str(bindir / "ray")

    # ---- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def env(self) -> dict[str, str]:
        """What every Ray process of this cluster needs: the token, and nothing sent home."""
        env = {
            k: v
            for k, v in environ.current().items()
            if not k.startswith(("RAY_", "RINGTRAIN_", "HOROVOD_", "MASTER_", "OMP_"))
        }
        env.update(
            {
                Ray.AUTH_MODE: "token",
                Ray.AUTH_TOKEN_PATH: str(self.token_path),
                Ray.USAGE_STATS_ENABLED: "0",
                # Ray runs its workers at nice 15 (it expects the machine to itself); here they
                # share the cores with other tests, which would starve them (10x the quiet time
                # beside `stress-ng --cpu 2`), so they run at the priority of everything else.
                Ray.WORKER_NICENESS: "0",
                Process.PYTHONUNBUFFERED: "1",
                # A 2-core machine: one torch thread per process keeps the hosts responsive.
                Threads.OMP_NUM_THREADS: "1",
            }
        )
        return env

    def temp_dir(self, host: str) -> str:
        # Short: Ray's unix sockets live below it and must fit in 107 characters.
        return f"/tmp/rtray-{self.cluster.prefix}-{host}"

    def start(self) -> RayCluster:
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        try:
            for host in self.hosts:
                self._start_node(host)
            self.wait_for_nodes(len(self.hosts))
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, host: str) -> None:
        h = self.cluster.host(host)
        shutil.rmtree(self.temp_dir(host), ignore_errors=True)
        argv = [
            self.ray_bin,
            "start",
            f"--node-ip-address={h.address}",
            f"--num-cpus={self.num_cpus}",
            "--num-gpus=0",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--temp-dir={self.temp_dir(host)}",
            "--disable-usage-stats",
        ]
        if host == self.head:
            argv += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.address}"]
        self._started.append(host)
        out = self.cluster.exec(host, argv, timeout=self.timeout_s, env=self.env)
        if out.returncode != 0:
            raise RayClusterError(
                f"`ray start` on {host} failed ({out.returncode}):\n{out.stdout[-3000:]}\n"
                f"{out.stderr[-3000:]}"
            )

    def wait_for_nodes(self, n: int) -> None:
        """Until the head reports ``n`` alive nodes (asked from inside the head's host)."""
        probe = (
            "import ray, sys; ray.init(address=sys.argv[1], _node_ip_address=sys.argv[2], "
            "logging_level='ERROR'); print(sum(1 for x in ray.nodes() if x['Alive']))"
        )
        deadline = time.monotonic() + self.timeout_s
        last = ""
        while time.monotonic() < deadline:
            out = self.run_driver(
                self.head, [sys.executable, "-c", probe, self.address, self.node_ip(self.head)]
            )
            lines = out.stdout.strip().splitlines()
            if out.returncode == 0 and lines and lines[-1] == str(n):
                return
            last = (lines[-1] if lines else "") or out.stderr[-2000:]
            time.sleep(1)
        raise RayClusterError(f"the Ray cluster did not reach {n} nodes: {last}")

    def node_ip(self, host: str) -> str:
        return self.cluster.host(host).address

    def run_driver(
        self,
        host: str,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a driver program inside ``host`` with the cluster's address and token."""
        full = {
            **self.env,
            Ray.ADDRESS: self.address,
            "RINGTRAIN_TEST_NODE_IP": self.node_ip(host),
            **(env or {}),
        }
        return self.cluster.exec(host, argv, timeout=timeout or self.timeout_s, env=full)

    def popen_driver(
        self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen[Any]:
        full = {
            **self.env,
            Ray.ADDRESS: self.address,
            "RINGTRAIN_TEST_NODE_IP": self.node_ip(host),
            **(env or {}),
        }
        return self.cluster.popen(host, argv, env=full, **kw)

    def daemons(self) -> dict[str, list[int]]:
        """Ray daemons (raylet, gcs_server) still running in each host, by host."""
        out: dict[str, list[int]] = {}
        for host in self.hosts:
            found = [p for p in self.cluster.pids(host) if _comm(p) in DAEMONS]
            if found:
                out[host] = found
        return out

    def stop(self) -> None:
        """Kill every Ray process in the cluster's hosts (their sshd is kept); idempotent."""
        for host in reversed(self._started):
            keep = {self.cluster.sshd_pid(host)}
            for _ in range(50):
                pids = [p for p in self.cluster.pids(host) if p not in keep and p != os.getpid()]
                if not pids:
                    break
                for p in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(p, signal.SIGKILL)
                time.sleep(0.1)
            shutil.rmtree(self.temp_dir(host), ignore_errors=True)
        self._started.clear()
        with contextlib.suppress(FileNotFoundError):
            self.token_path.unlink()


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
