"""The launcher side of a job: agents up, ranks started, output relayed, first failure acted on.

Failure policy (elastic jobs, ``--min-np``/``--max-np``: see :mod:`ringtrain.launch.elastic`): a
rank that fails is dropped and the others told to re-form the world, while at least ``--min-np``
remain. With ``--host-discovery-script`` (:mod:`ringtrain.launch.discovery`) the launcher also
starts ranks on hosts the script offers (up to ``--max-np``), retires those of hosts it no
longer offers, excludes hosts whose ranks failed, and below ``--min-np`` waits up to
``--elastic-timeout`` for new hosts (that part is :mod:`ringtrain.launch.elastic_hosts`); below
that, or without those flags, the policy below applies.

Failure policy: the first rank that exits non-zero (or is killed by a signal) ends the job. The
others get SIGTERM, then SIGKILL after a grace period; the launcher exits with that rank's code
(128 + signal number for a signal) after a message naming the rank, its host, how it ended and
the last lines of its error output. Ctrl-C is forwarded to every rank as SIGINT; a second Ctrl-C
stops them at once. A host whose agent link breaks counts as a failure of all its ranks.

The parts: :mod:`~ringtrain.launch.agent_link` (one agent process and its messages),
:mod:`~ringtrain.launch.job_network` (interfaces checked on every host before ranks start),
:mod:`~ringtrain.launch.failures` (how an end is worded), :mod:`~ringtrain.launch.rank_output`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from types import FrameType
from typing import IO, Any

from ringtrain import environ
from ringtrain.config import to_env
from ringtrain.environ import horovod_unused
from ringtrain.errors import LaunchError
from ringtrain.host import network
from ringtrain.launch import discovery, elastic, job_network, rank_env, transport
from ringtrain.launch.agent import FAILING_GRACE_S
from ringtrain.launch.agent_link import AgentLink, unreachable
from ringtrain.launch.elastic_hosts import ElasticHosts
from ringtrain.launch.exit_policy import Next, RankExit, decide
from ringtrain.launch.failures import Failure, how_it_ended, report, root_cause
from ringtrain.launch.hosts import Host
from ringtrain.launch.options import LaunchOptions
from ringtrain.launch.plan import ProcessSpec, describe, plan
from ringtrain.launch.rank_output import RankOutput
from ringtrain.launch.rendezvous import RendezvousServer
from ringtrain.launch.tuning import HostFacts, tune

__all__ = ["AgentLink", "Failure", "Supervisor"]


class Supervisor(ElasticHosts):
    """Runs one job to completion; :meth:`run` returns the launcher's exit code."""

    def __init__(
        self,
        options: LaunchOptions,
        env: Mapping[str, str] | None = None,
        out: IO[str] | None = None,
        err: IO[str] | None = None,
        on_result: Callable[[int, str], None] | None = None,
    ) -> None:
        self.options = options
        self.env = dict(environ.current() if env is None else env)
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self._hosts = list(options.hosts)
        # With a discovery script the hosts are known only once it ran (in run()).
        self.specs = (
            []
            if options.discovery_script
            else plan(options.np, options.hosts, options.command, options.placement)
        )
        self.job_id = uuid.uuid4().hex[:12]
        self._events: queue.Queue[Any] = queue.Queue()
        self._links: list[AgentLink] = []
        self._pids: dict[int, int] = {}
        self._exits: dict[int, dict[str, Any]] = {}
        self._failure: Failure | None = None  # the first heard of: what the launcher acted on
        self._failures: list[Failure] = []  # every failure heard of (report: earliest first)
        self._interrupts = 0
        self._stop_deadline: float | None = None
        self._started_at = time.monotonic()
        self.output = RankOutput(options, self.out, self.err, on_result)
        self._server: RendezvousServer | None = None
        self._membership: elastic.Membership | None = None
        # Elastic growth (--host-discovery-script): see the "elastic hosts" section.
        self._exclusions = discovery.Exclusions(options.cooldown_range)
        self._poller: discovery.Poller | None = None
        self._offered: list[Host] = []
        self._rank_host: dict[int, str] = {}  # every rank ever started: identity -> host
        self._joiners: dict[int, float] = {}  # started, not yet in a world: id -> ready by
        self._retired: set[int] = set()  # stopped on purpose (host no longer offered)
        self._left: list[str] = []  # how each rank that left the world went
        self._below: tuple[float, Failure] | None = None  # below --min-np since, and why
        self._growing = True  # until a rank finishes
        self._next_check = 0.0
        self._run_env: dict[str, Any] = {}

    # ---- public ------------------------------------------------------------------------------

    def run(self) -> int:
        prior = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_sigint)
            signal.signal(signal.SIGTERM, self._on_sigint)
        server = None
        try:
            self._log(f"job {self.job_id}: {describe(self.specs)}")
            unused = horovod_unused(self.env)
            if unused:
                self._log(
                    "accepted without effect here: "
                    + "; ".join(f"{var} ({why})" for var, why in unused)
                )
            server = RendezvousServer(
                self.options.python,
                float(self.options.settings.get("timeout_s") or 300.0),
                self.options.start_timeout_s,
            )
            self._server = server
            if self.options.discovery_script:
                self._first_discovery()
            self._rank_host = {s.rank: s.host for s in self.specs}
            if self.options.elastic:
                self._membership = elastic.Membership(
                    [s.rank for s in self.specs],
                    self.options.min_np if self.options.min_np is not None else self.options.np,
                )
            self._start_agents()
            self._await_hellos()
            self._start_ranks(server.chosen_port)
            self._check_server(server)
            if self.options.discovery_script:
                self._poller = discovery.Poller(
                    self.options.discovery_script,
                    self.options.slots_per_host,
                    lambda found: self._events.put((None, {"t": "hosts", "found": found})),
                )
                self._poller.start()
            self._supervise()
        except LaunchError as e:
            if self._failure is None and not self._interrupts:
                self._failure = Failure(None, "", 1, str(e), [])
            self._stop_all(hard=True)
        finally:
            if self._poller is not None:
                self._poller.stop()
            for link in self._links:
                link.close_input()
            self._drain(deadline=time.monotonic() + self.options.grace_s + 2.0)
            for link in self._links:
                link.kill()
            if server is not None:
                server.close()
            self.output.close()
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, prior)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return self._report()

    # ---- phases ------------------------------------------------------------------------------

    def _hosts_in_use(self) -> list[Host]:
        used = {s.host for s in self.specs}
        return [h for h in self._hosts if h.name in used]

    def _is_local(self) -> bool:
        return all(h.is_local for h in self._hosts)

    def _check_server(self, server: RendezvousServer) -> None:
        if server.port != server.chosen_port:  # pragma: no cover - the server binds what it's told
            raise LaunchError(
                f"the rendezvous store bound port {server.port}, not {server.chosen_port}"
            )

    def _start_agents(self) -> None:
        for host in self._hosts_in_use():
            link = self._start_agent(host)
            link.ranks = [s.rank for s in self.specs if s.host == host.name]

    def _start_agent(self, host: Host) -> AgentLink:
        argv = transport.command_for(
            host,
            self.options.ssh,
            self.options.python,
            os.getcwd(),
            # Enclave jobs look up only the named interfaces (enclaves lack netlink).
            not job_network.enclave_ready(self.options.settings),
            network.spec_names(str(self.options.settings.get("network_interface") or "")),
        )
        self._log(f"agent on {host.name}: {' '.join(argv)}")
        try:
            link = AgentLink(len(self._links), host, argv, self._events)
        except OSError as e:
            raise LaunchError(f"cannot start the agent for host {host.name}: {e}") from e
        self._links.append(link)
        return link

    def _await_hellos(self) -> None:
        deadline = time.monotonic() + self.options.start_timeout_s
        while any(link.hello is None for link in self._links):
            if self._interrupts:
                raise LaunchError("interrupted while starting")
            try:
                link, msg = self._events.get(
                    timeout=max(0.0, min(0.1, deadline - time.monotonic()))
                )
            except queue.Empty:
                if time.monotonic() >= deadline:
                    missing = [lk for lk in self._links if lk.hello is None]
                    raise LaunchError(  # noqa: B904 - the timeout is the error, not Empty
                        unreachable(
                            missing, f"did not answer within {self.options.start_timeout_s:.0f} s"
                        )
                    )
                continue
            if msg["t"] == "hello":
                link.hello = msg
            elif msg["t"] == "eof":
                raise LaunchError(unreachable([link], "exited before it started"))

    def _start_ranks(self, port: int) -> None:
        addr, host_env = self._network()
        key = None
        if self.options.settings.get("secure") and not self.options.settings.get("key_file"):
            key = secrets.token_bytes(32).hex()
        # Kept for ranks started later on hosts a discovery script adds.
        self._run_env = {
            "rdzv": rank_env.Rendezvous(addr, port, self.job_id),
            "settings": to_env(**self.options.settings),
            "key": key,
        }
        by_host: dict[str, list[ProcessSpec]] = {}
        for s in self.specs:
            by_host.setdefault(s.host, []).append(s)
        for link in self._links:
            specs = by_host[link.host.name]
            self._launch(link, specs, [s.rank for s in specs], host_env.get(link.host.name, {}))
        self._started_at = time.monotonic()

    def _launch(
        self,
        link: AgentLink,
        specs: list[ProcessSpec],
        identities: list[int],
        host_net: dict[str, str],
        join: bool = False,
        bind_to: str | None = None,
    ) -> None:
        """Start ``specs`` on ``link``'s host; ``identities`` are their elastic identities."""
        assert link.hello is not None
        f = link.hello["facts"]
        facts = HostFacts(
            hostname=f.get("hostname", link.host.name),
            cpus=tuple(f.get("cpus", ())),
            numa_nodes=tuple(tuple(n) for n in f.get("numa_nodes", ())),
            allocators=f.get("allocators", {}),
            cpu_quota=f.get("cpu_quota"),
        )
        base = (
            rank_env.explicit(self.env, self.options.forward_env)
            if link.host.is_local
            else rank_env.forwarded(self.env, self.options.forward_env)
        )
        tunings = tune(
            facts,
            len(specs),
            bind_to or self.options.bind_to,
            self.options.malloc,
            {**self.env, **base},
        )
        ranks = []
        # The user's own GLOO_/NCCL_ interface variables win over what ringtrain chose.
        net = {
            k: v for k, v in host_net.items() if k.startswith(environ.PREFIX) or k not in self.env
        }
        for s, ident, t in zip(specs, identities, tunings):
            env = {**base, **self._run_env["settings"], **net, **t.env}
            env.update(rank_env.placement(s, self._run_env["rdzv"]))
            if self.options.elastic:
                env.update(
                    elastic.rank_env(
                        ident, self.options.elastic_timeout_s, self.options.reset_limit, join
                    )
                )
            ranks.append(
                {
                    "rank": ident,
                    "argv": list(s.argv),
                    "env": env,
                    "cpus": list(t.cpus) if t.cpus else None,
                }
            )
            self._log(f"rank {ident} on {link.host.name}: {t.summary}")
        link.send(
            "start",
            ranks=ranks,
            cwd=os.getcwd(),
            key=self._run_env["key"],
            grace_s=self.options.grace_s,
        )

    def _network(self) -> tuple[str, dict[str, dict[str, str]]]:
        """The rendezvous address every host can reach, and per-host interface variables."""
        iface = job_network.named_interface(self.options, self.env)
        if iface.strip():
            job_network.check_interface(iface, self._links, self.options.settings)
        if self._is_local():
            return "127.0.0.1", {}
        return job_network.plan(self._links, iface, self.options)

    def _supervise(self) -> None:
        while not all(lk.done or lk.lost for lk in self._links):
            self._handle_interrupts()
            if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                self._log("ranks did not stop in time; killing their agents")
                for lk in self._links:
                    lk.kill()
                self._stop_deadline = time.monotonic() + 5.0
            if self.options.discovery_script:
                self._elastic_tick()
            try:
                link, msg = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            self._handle(link, msg)

    def _drain(self, deadline: float) -> None:
        while not all(lk.done or lk.lost for lk in self._links) and time.monotonic() < deadline:
            try:
                link, msg = self._events.get(timeout=0.05)
            except queue.Empty:
                continue
            self._handle(link, msg)

    # ---- events ------------------------------------------------------------------------------

    def _handle(self, link: AgentLink | None, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if link is None:
            if kind == "hosts":
                self._on_discovered(msg["found"])
            return
        if kind == "out":
            self.output.print_line(msg["rank"], msg["fd"], msg["line"], msg.get("end", "\n"))
        elif kind == "hello" and link.joining and link.hello is None:
            self._on_joiner_hello(link, msg)
        elif kind == "started":
            self._pids[msg["rank"]] = msg["pid"]
        elif kind == "exit":
            self._on_exit(link, msg)
        elif kind == "done":
            link.done = True
        elif kind == "eof" and not link.done:
            link.lost = True
            if self._failure is not None or self._interrupts:
                return
            alive = [r for r in link.ranks if r not in self._exits and r not in self._retired]
            if not alive:
                return
            desc = (
                f"lost the connection to host {link.host.name}'s agent "
                f"(ranks {', '.join(str(r) for r in link.ranks)})"
            )
            if all(r in self._joiners for r in alive):
                if link.err_tail:  # e.g. ssh's reason: the failure is reported only in one line
                    desc += f": {link.err_tail[-1]}"
                self._joiner_failed(link, alive, desc)
                return
            if self._membership is not None:
                self._exclude(link.host.name, desc)
                if self._reform(desc, *alive):
                    return
                if self._await_hosts(desc, Failure(None, link.host.name, 1, desc, [])):
                    return
                desc += self._shortfall()
            self._fail(Failure(None, link.host.name, 1, desc, list(link.err_tail)))

    def _on_exit(self, link: AgentLink, msg: dict[str, Any]) -> None:
        rank = msg["rank"]
        self._exits[rank] = msg
        pid = self._pids.get(rank)
        step = decide(
            RankExit(
                succeeded=msg.get("code") == 0 and msg.get("signal") is None,
                retired=rank in self._retired,
                interrupted=bool(self._interrupts),
                job_failed=self._failure is not None,
                stopped_by_launcher=bool(msg.get("stopped")),
                said_failing=bool(msg.get("failing")),
                joining=rank in self._joiners,
                elastic=self._membership is not None,
                started=pid is not None,
            )
        )
        if step is Next.STOPPED:
            self._log(f"rank {rank} (host {link.host.name}) stopped")
            return
        if step is Next.FINISHED:
            if self._growing and self._membership is not None and self._joiners:
                self._retire_joiners("a rank finished")
            self._growing = False  # the job is finishing: no new ranks
            return
        if step is Next.IGNORE:
            return
        failure = self._exit_failure(link.host.name, msg, pid)
        if step is Next.ALSO_FAILED:
            self._failures.append(failure)
        elif step is Next.JOINER_FAILED:
            self._joiner_failed(link, [rank], failure.description)
        elif step is Next.REFORM:
            self._exclude(link.host.name, failure.description)
            if self._reform(failure.description, rank) or self._await_hosts(
                failure.description, failure
            ):
                return
            failure.description += self._shortfall()
            self._fail(failure)
        else:
            self._fail(failure)

    def _exit_failure(self, host: str, msg: dict[str, Any], pid: int | None) -> Failure:
        """How a failed rank's exit is reported (see :mod:`ringtrain.launch.failures`)."""
        rank = msg["rank"]
        how, exit_code = how_it_ended(msg)
        tail = list(msg.get("tail") or [])
        if pid is None:  # the agent could not even start the command
            desc = f"rank {rank} (host {host}) could not start: {tail[-1] if tail else how}"
        else:
            elapsed = time.monotonic() - self._started_at
            desc = f"rank {rank} (host {host}, pid {pid}) {how} after {elapsed:.1f} s"
        at = float(msg.get("at") or time.time())
        return Failure(rank, host, exit_code, desc, tail, at, bool(msg.get("after_peer")))

    def _fail(self, failure: Failure) -> None:
        if not failure.at:
            failure.at = time.time()
        self._failure = failure
        self._failures.append(failure)
        others = len(
            [r for r in self._rank_host if r not in self._exits and r not in self._retired]
        )
        self._say(f"{failure.description}; stopping the other {others} rank(s).")
        self._stop_all(hard=False)

    def _send_stop(self) -> None:
        for lk in self._links:
            lk.send("stop")

    def _stop_all(self, hard: bool) -> None:
        self._send_stop()
        # The agents give ranks that said they are failing FAILING_GRACE_S more to end alone.
        grace = 0.0 if hard else self.options.grace_s + FAILING_GRACE_S
        self._stop_deadline = time.monotonic() + grace + 3.0

    def _on_sigint(self, signum: int, _frame: FrameType | None) -> None:
        self._interrupts += 1  # acted on by the supervising loop, not in the handler

    def _handle_interrupts(self) -> None:
        if not self._interrupts or getattr(self, "_handled_interrupts", 0) == self._interrupts:
            return
        first = not getattr(self, "_handled_interrupts", 0)
        self._handled_interrupts = self._interrupts
        if first:
            self._say("interrupted: forwarding SIGINT to every rank (again to stop at once)")
            for lk in self._links:
                lk.send("signal", sig="SIGINT")
            self._stop_deadline = time.monotonic() + self.options.grace_s + 3.0
            # Ranks that ignore SIGINT still end: the agents escalate after the grace period.
            timer = threading.Timer(self.options.grace_s, self._send_stop)
            timer.daemon = True
            timer.start()
        else:
            self._stop_all(hard=True)

    def _say(self, text: str) -> None:
        with contextlib.suppress(BrokenPipeError, ValueError):
            self.err.write(f"ringtrain run: {text}\n")
            self.err.flush()

    def _log(self, text: str) -> None:
        if self.options.verbose:
            self._say(text)

    def _report(self) -> int:
        f = self._failure
        if self._interrupts and f is None:
            self._say("job interrupted")
            return 130
        if f is None:
            self._log(
                f"all {len(self.specs)} ranks exited 0 in "
                f"{time.monotonic() - self._started_at:.1f} s"
            )
            return 0
        every = self._failures or [f]
        self._say(report(every))
        return root_cause(every).code
