"""Elastic hosts: ``--host-discovery-script`` and the exclusion of failing hosts.

The contract is ``horovodrun``'s: the script prints one host per line, ``host:slots`` or just
``host`` (then ``--slots-per-host`` slots); blank lines are ignored, so a script may print
nothing while no host is ready. The launcher runs it at start and then every
:data:`EVERY_S` seconds (:class:`Poller`); a script that fails at start is a configuration error,
later failures are reported and retried.

A host whose rank fails is excluded (Horovod's blacklist). Without a cool-down range it stays
excluded for the rest of the job; with ``--blacklist-cooldown-range MIN MAX`` its n-th exclusion
lasts ``MIN * 2**n`` seconds plus up to ``MIN`` of jitter, kept within ``[MIN, MAX]``
(:class:`Exclusions`), after which the host is offered again.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ringtrain.errors import LaunchError
from ringtrain.launch.hosts import Host, parse_hosts

EVERY_S = 1.0  # as horovodrun
SCRIPT_TIMEOUT_S = 60.0


def parse(text: str, slots_per_host: int, script: str = "the discovery script") -> list[Host]:
    """The hosts in ``text``, in the order printed (a host printed twice counts once)."""
    hosts: dict[str, Host] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        spec = line if ":" in line else f"{line}:{slots_per_host}"
        try:
            (host,) = parse_hosts(spec)
        except (LaunchError, ValueError) as e:
            what = str(e).splitlines()[0]  # its own HINT is for -H; this one is for the script
            raise LaunchError(
                f"{script} printed {line!r}: {what}\nHINT: print one 'host:slots' or 'host' per line"
            ) from None
        hosts.setdefault(host.name, host)
    return list(hosts.values())


def run_script(script: str, slots_per_host: int) -> list[Host]:
    """Run ``script`` once (through the shell, as horovodrun does) and parse what it printed."""
    try:
        proc = subprocess.run(
            script,
            shell=True,
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"--host-discovery-script {script!r} did not finish within {SCRIPT_TIMEOUT_S:.0f} s"
        ) from None
    except OSError as e:
        raise LaunchError(f"cannot run --host-discovery-script {script!r}: {e}") from None
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()[-3:]
        raise LaunchError(
            f"--host-discovery-script {script!r} exited with code {proc.returncode}"
            + (": " + " | ".join(err) if err else "")
        )
    return parse(proc.stdout, slots_per_host, f"--host-discovery-script {script!r}")


class Poller:
    """Runs the script every :data:`EVERY_S` in a thread; hands each result (a host list, or
    the :class:`LaunchError` it raised) to ``deliver``."""

    def __init__(
        self,
        script: str,
        slots_per_host: int,
        deliver: Callable[[list[Host] | LaunchError], None],
    ) -> None:
        self._script = script
        self._slots = slots_per_host
        self._deliver = deliver
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(EVERY_S):
            try:
                result: list[Host] | LaunchError = run_script(self._script, self._slots)
            except LaunchError as e:
                result = e
            if not self._stop.is_set():
                self._deliver(result)


@dataclass
class _HostState:
    failures: int = 0
    until: float | None = None  # excluded until then (monotonic); inf: for good


@dataclass
class Exclusions:
    """Which hosts are excluded now, and for how long each new failure excludes one."""

    cooldown: tuple[float, float] | None = None
    clock: Callable[[], float] = time.monotonic
    jitter: Callable[[], float] = random.random
    _hosts: dict[str, _HostState] = field(default_factory=dict)

    def fail(self, host: str) -> float | None:
        """Record a failure of ``host``; exclude it. Returns the cool-down in seconds, or None
        when it stays excluded for the rest of the job (no cool-down range)."""
        st = self._hosts.setdefault(host, _HostState())
        st.failures += 1
        if self.cooldown is None:
            st.until = float("inf")
            return None
        lo, hi = self.cooldown
        delay = max(lo, min(hi, lo * (1 << st.failures) + self.jitter() * lo))
        st.until = self.clock() + delay
        return delay

    def failures(self, host: str) -> int:
        st = self._hosts.get(host)
        return st.failures if st else 0

    def excluded(self, host: str) -> bool:
        st = self._hosts.get(host)
        return bool(st and st.until is not None and st.until > self.clock())

    def remaining_s(self, host: str) -> float | None:
        """Seconds left in ``host``'s exclusion (inf for good), None when it is not excluded."""
        st = self._hosts.get(host)
        if st is None or st.until is None or st.until <= self.clock():
            return None
        return st.until - self.clock()
