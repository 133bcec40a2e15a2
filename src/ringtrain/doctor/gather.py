"""The doctor's I/O: run the probe on every host, test the links, run a tiny allreduce job.

Every host is reached the way ``ringtrain run`` reaches it: a local child process, or the user's
OpenSSH client through :func:`ringtrain.launch.agent_start.ssh_argv` (same options, same
``-F`` config). An ssh failure is told apart from a probe failure by ssh's own exit code, 255,
and quoted from ssh's stderr. The allreduce job is a real ringtrain job, run by the launcher's
:class:`~ringtrain.launch.supervisor.Supervisor`. Nothing here imports torch: the probe does.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ringtrain.doctor import findings, wire
from ringtrain.doctor.findings import LinkSample
from ringtrain.host.network import Interface
from ringtrain.launch import agent_start
from ringtrain.launch.hosts import Host
from ringtrain.launch.options import LaunchOptions, SshOptions
from ringtrain.launch.supervisor import Supervisor

SSH_FAILED = 255
TAIL = 12
# Retests beyond the first for a slow pair that no slow host explains (see measure_links).
UNEXPLAINED_RETESTS = 2


@dataclass(frozen=True)
class Reach:
    """How the probe is started on the hosts."""

    ssh: SshOptions = field(default_factory=SshOptions)
    python: str = sys.executable
    cwd: str = field(default_factory=os.getcwd)

    def argv(self, host: Host, args: Sequence[str], deadline_s: float) -> list[str]:
        remote = [self.python, "-m", wire.PROBE_MODULE, "--deadline", f"{deadline_s:.0f}", *args]
        return remote if host.is_local else agent_start.ssh_argv(host, self.ssh, remote, self.cwd)

    def run(self, host: Host, args: Sequence[str], deadline_s: float, late: str) -> ProbeRun:
        """Run one probe subcommand on ``host`` to its end; ``late`` says it did not end in time.

        ssh gets its connect timeout on top of the probe's own ``deadline_s``.
        """
        argv = self.argv(host, args, deadline_s)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=deadline_s + self.ssh.connect_timeout_s,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            return ProbeRun(host, argv, time.monotonic() - t0, unfinished=late)
        except OSError as e:
            return ProbeRun(
                host, argv, 0.0, unfinished=f"cannot start {argv[0]!r} for {host.name}: {e}"
            )
        return ProbeRun(
            host, argv, time.monotonic() - t0, proc.returncode, proc.stdout, proc.stderr
        )


@dataclass(frozen=True)
class ProbeRun:
    """How one probe subcommand on one host ended: its output, or why it never finished."""

    host: Host
    argv: list[str]
    seconds: float
    returncode: int = 0
    stdout: str = ""
    stderr: str = ""
    unfinished: str | None = None  # it timed out or could not start

    @property
    def ok(self) -> bool:
        return self.unfinished is None and self.returncode == 0

    @property
    def records(self) -> list[dict[str, Any]]:
        return wire.records(self.stdout.splitlines())

    def failure(self) -> tuple[bool, str]:
        """(reachable, message) for a run that did not give what was asked of it."""
        if self.unfinished is not None:
            return False, self.unfinished
        return _failure(self.host, self.argv, self.returncode, self.stderr or self.stdout)


@dataclass
class HostProbe:
    """One host's facts, or why there are none."""

    name: str
    reachable: bool
    error: str | None = None
    facts: dict[str, Any] | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "reachable": self.reachable,
            "error": self.error,
            "facts": self.facts,
            "seconds": round(self.seconds, 3),
        }


def _tail(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n    ".join(lines[-TAIL:]) or "(no output)"


def _failure(host: Host, argv: Sequence[str], rc: int, stderr: str) -> tuple[bool, str]:
    """(reachable, message) for a probe that exited ``rc``; ssh's own failures exit 255."""
    if not host.is_local and rc == SSH_FAILED:
        return False, (
            f"host {host.name} is unreachable: ssh failed (exit {rc}):\n    {_tail(stderr)}\n"
            f"HINT: `ssh {host.name} true` must work without a prompt (BatchMode): check the "
            "name, port, key and known_hosts (--ssh-config-file, -p, --ssh-identity-file, "
            "--ssh-accept-new-host-keys)."
        )
    where = "this machine" if host.is_local else f"host {host.name}"
    if rc == 127:
        return True, (
            f"the Python that runs ringtrain was not found on {where}:\n    {_tail(stderr)}\n"
            "HINT: ringtrain runs the same interpreter path on every host; install it there."
        )
    return True, (
        f"the probe failed on {where} (exit {rc}):\n    {_tail(stderr)}\n"
        f"HINT: `{' '.join(argv if host.is_local else argv[-1:])}` must work there: ringtrain "
        "and torch installed for the same Python path as on this machine."
    )


def probe_host(host: Host, reach: Reach, timeout_s: float) -> HostProbe:
    late = (
        f"host {host.name} did not answer within {timeout_s:.0f} s.\n"
        "HINT: check that ssh to it works and that it is not overloaded."
    )
    run = reach.run(host, ["facts"], timeout_s, late)
    facts = next((r["facts"] for r in run.records if "facts" in r), None)
    if not run.ok or facts is None:
        reachable, msg = run.failure()
        return HostProbe(host.name, reachable, msg, seconds=run.seconds)
    return HostProbe(host.name, True, None, facts, run.seconds)


def probe_hosts(hosts: Sequence[Host], reach: Reach, timeout_s: float) -> list[HostProbe]:
    """Every host's facts, probed in parallel."""
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(hosts)))) as pool:
        return list(pool.map(lambda h: probe_host(h, reach, timeout_s), hosts))


# ---- links ------------------------------------------------------------------------------------


class _Receiver:
    """``probe serve`` on one host; its stdin is the lifeline that ends it."""

    def __init__(self, host: Host, address: str, reach: Reach, deadline_s: float) -> None:
        self.host = host
        self.address = address
        self.port: int | None = None
        self.error: str | None = None
        self.argv = reach.argv(host, ["serve", "--bind", address], deadline_s)
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.port is None and self.error is None:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.error = f"the link test receiver on {self.host.name} did not start in time"
                return
            if line is None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                self.proc.wait()
                _, self.error = _failure(self.host, self.argv, self.proc.returncode or 1, err)
                return
            for r in wire.records([line]):
                if "error" in r:
                    self.error = f"on {self.host.name}: {r['error']}"
                elif "port" in r:
                    self.port = int(r["port"])

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stderr is not None:
                self.proc.stderr.close()


def measure_links(
    hosts: Sequence[Host],
    chosen: Mapping[str, Interface],
    reach: Reach,
    seconds: float,
    rtts: int = 20,
    timeout_s: float = 60.0,
) -> tuple[list[LinkSample], set[findings.Pair]]:
    """Latency and bandwidth for every ordered pair of ``hosts``, one sender at a time, and
    the pairs cleared of slowness by a retest (for :func:`findings.analyze_links`).

    A receiver listens on each host's chosen address; then each host in turn runs one sender
    that measures to every other host, so no two measurements share a link. Pairs that came out
    slow are measured again and keep their best figure: on a busy host one test can come out
    slow for want of CPU, and noise only ever lowers a throughput. A slow pair between two fast
    hosts (no slow host explains it) is the likelier accident: it is measured again, up to
    :data:`UNEXPLAINED_RETESTS` times, right before the links that give its hosts their
    capacity, and cleared if it is not slow beside them (:func:`findings.slow_beside`): a
    fast link is CPU-bound, so a load that came after its reverse was measured can halve it
    in every retest, but it lowers the links measured beside it alike.
    """
    receivers: dict[str, _Receiver] = {}
    samples: list[LinkSample] = []
    cleared: set[findings.Pair] = set()
    deadline = timeout_s + (2 + 3 * UNEXPLAINED_RETESTS) * len(hosts) ** 2 * (seconds + 5)
    try:
        for h in hosts:
            receivers[h.name] = _Receiver(h, chosen[h.name].address, reach, deadline)
        for r in receivers.values():
            r.wait_ready(timeout_s)
        for src in hosts:
            targets = [
                receivers[d.name] for d in hosts if d.name != src.name and receivers[d.name].port
            ]
            for d in hosts:
                rec = receivers[d.name]
                if d.name != src.name and rec.error is not None:
                    samples.append(LinkSample(src.name, d.name, error=rec.error))
            if targets:
                samples.extend(_send(src, targets, reach, seconds, rtts, timeout_s))
        by_name = {h.name: h for h in hosts}

        def send(pairs: Sequence[findings.Pair]) -> list[LinkSample]:
            out: list[LinkSample] = []
            # In the order given (a round's pairs back to back), one sender per run of a source.
            for src, run in itertools.groupby(pairs, key=lambda p: p[0]):
                targets = [receivers[dst] for _, dst in run]
                out += _send(by_name[src], targets, reach, seconds, rtts, timeout_s)
            return out

        analysis = findings.analyze_links(samples)
        samples = keep_better(samples, send(sorted(analysis.slow_pairs)))
        for _ in range(UNEXPLAINED_RETESTS):
            analysis = findings.analyze_links(samples, cleared=cleared)
            hosts_slow = set(analysis.slow_hosts)
            unexplained = [p for p in analysis.slow_pairs if not set(p) & hosts_slow]
            for pair in unexplained:
                measured = send([pair, *findings.reference_pairs(samples, pair)])
                samples = keep_better(samples, measured)
                if not findings.slow_beside(pair, measured):
                    cleared.add(pair)
            if not unexplained:
                break
    finally:
        for r in receivers.values():
            r.close()
    return samples, cleared


def keep_better(samples: Sequence[LinkSample], retests: Sequence[LinkSample]) -> list[LinkSample]:
    """``samples`` with each pair's retest in place of its first figure where the retest moved
    more bytes per second (a failed retest, no throughput, never replaces a figure)."""
    out = list(samples)
    for retest in retests:
        for i, s in enumerate(out):
            if (s.src, s.dst) == (retest.src, retest.dst):
                if (retest.bytes_per_s or 0.0) > (s.bytes_per_s or 0.0):
                    out[i] = retest
                break
    return out


def _send(
    src: Host,
    targets: Sequence[_Receiver],
    reach: Reach,
    seconds: float,
    rtts: int,
    timeout_s: float,
) -> list[LinkSample]:
    args = ["send", "--seconds", str(seconds), "--rtts", str(rtts)]
    args += ["--connect-timeout", str(reach.ssh.connect_timeout_s)]
    for t in targets:
        args += ["--to", f"{t.address}:{t.port}"]
    budget = timeout_s + len(targets) * (seconds + 10)
    late = f"the link test sender on {src.name} did not finish in time"
    run = reach.run(src, args, budget, late)
    found = [r["link"] for r in run.records if "link" in r]
    failed = None if run.ok else run.failure()[1]
    out = []
    for t in targets:
        r = next(
            (x for x in found if x.get("address") == t.address and x.get("port") == t.port), None
        )
        if r is None:
            out.append(LinkSample(src.name, t.host.name, error=failed or "no result"))
        elif r.get("error"):
            out.append(LinkSample(src.name, t.host.name, error=str(r["error"])))
        else:
            out.append(
                LinkSample(src.name, t.host.name, float(r["bytes_per_s"]), float(r["rtt_s"]))
            )
    return out


# ---- allreduce --------------------------------------------------------------------------------


def allreduce_job(
    hosts: Sequence[Host],
    reach: Reach,
    sizes: Sequence[int],
    budget_s: float,
    start_timeout_s: float,
    network_interface: str = "",
) -> dict[str, Any]:
    """Bus bandwidth of a ringtrain allreduce: one rank per host, or 2 ranks on one host.

    Returns the probe's result (``allreduce``: a list of points, ``world``, ...) or
    ``{"error": ...}`` with the launcher's and ranks' last words.
    """
    if len(hosts) == 1:
        job_hosts: tuple[Host, ...] = (Host(hosts[0].name, 2),)
    else:
        job_hosts = tuple(Host(h.name, 1) for h in hosts)
    np = sum(h.slots for h in job_hosts)
    command = (
        reach.python,
        "-m",
        wire.PROBE_MODULE,
        "--deadline",
        f"{budget_s + start_timeout_s + 30:.0f}",
        "allreduce",
        "--sizes",
        ",".join(str(s) for s in sizes),
        "--budget",
        str(budget_s),
    )
    # A measuring job saves nothing: Ctrl-C ends it within a second, as a failure does.
    settings: dict[str, Any] = {"timeout_s": max(30.0, budget_s * 2), "grace_period_s": 1.0}
    if network_interface:
        settings["network_interface"] = network_interface
    options = LaunchOptions(
        np=np,
        hosts=job_hosts,
        command=command,
        settings=settings,
        ssh=reach.ssh,
        start_timeout_s=start_timeout_s,
        grace_s=1.0,
        prefix_output=False,
        python=reach.python,
    )
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    code = Supervisor(options, out=out, err=err).run()
    took = time.monotonic() - t0
    found = [r for r in wire.records(out.getvalue().splitlines()) if "allreduce" in r]
    if code != 0 or not found:
        tail = _tail(err.getvalue() + "\n" + out.getvalue())
        return {
            "error": f"the allreduce test job ({np} ranks) failed with exit code {code}:\n    {tail}",
            "seconds": took,
        }
    # Ranks fill the hosts in order (the launcher's plan): the host of each rank's figures.
    rank_hosts = [h.name for h in job_hosts for _ in range(h.slots)]
    return {
        **found[0],
        "seconds": took,
        "hosts": [h.name for h in job_hosts],
        "rank_hosts": rank_hosts,
    }
