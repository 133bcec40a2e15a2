"""The launcher side of a job: agents up, ranks started, output relayed, first failure acted on.

Failure policy (elastic jobs, ``--min-np``/``--max-np``: see :mod:`ringtrain.launch.elastic`): a
rank that fails is dropped and the others told to re-form the world, while at least ``--min-np``
remain. With ``--host-discovery-script`` (:mod:`ringtrain.launch.discovery`) the launcher also
starts ranks on hosts the script offers (up to ``--max-np``), retires those of hosts it no
longer offers, excludes hosts whose ranks failed, and below ``--min-np`` waits up to
``--elastic-timeout`` for new hosts (the pool of :mod:`ringtrain.launch.elastic_hosts`, which
the supervisor owns); below that, or without those flags, the policy below applies.

The job is in one state (:mod:`ringtrain.launch.job_state`: starting, running, re-forming,
waiting for hosts, stopping, done); every event goes through that module's pure
:func:`~ringtrain.launch.job_state.on`, and this class carries out the actions it returns.

Failure policy: the first rank that exits non-zero (or is killed by a signal) ends the job. The
others get SIGTERM, then SIGKILL 3 s later; the launcher exits with that rank's code
(128 + signal number for a signal) after a message naming the rank, its host, how it ended and
the last lines of its error output. Ctrl-C is forwarded to every rank once as SIGINT (exit 130),
a SIGTERM as SIGTERM (exit 143); ranks still running after ``--grace-period`` (Config's
``grace_period_s``) are SIGKILLed, at once after a second signal, and the last message names
them. A host whose agent link breaks counts as a failure of all its ranks.

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
from ringtrain.config import Config, to_env
from ringtrain.environ import horovod_unused
from ringtrain.errors import ConfigError, LaunchError
from ringtrain.host import network
from ringtrain.launch import agent_start, discovery, elastic, job_network, job_state, rank_env
from ringtrain.launch.agent import FAILING_GRACE_S, PEER_NOTICE_S
from ringtrain.launch.agent_link import AGENT_EXIT_S, AgentLink, unreachable
from ringtrain.launch.elastic_hosts import Change, ElasticPool
from ringtrain.launch.exit_policy import Next, RankExit, decide
from ringtrain.launch.failures import (
    Failure,
    Interruption,
    acted_on,
    exit_failure,
    exited_key,
    interrupted_report,
    preempted,
    recorded_end,
    report,
    root_cause,
    stopped_on_preemption,
    survived_report,
)
from ringtrain.launch.hosts import Host
from ringtrain.launch.options import LaunchOptions
from ringtrain.launch.plan import ProcessSpec, describe, plan
from ringtrain.launch.rank_output import RankOutput, stamp
from ringtrain.launch.rendezvous import RendezvousServer
from ringtrain.launch.tuning import HostFacts, tune

__all__ = ["AgentLink", "Failure", "Supervisor"]

# The phases in which the world is changing until no rank waits to join and --min-np are in.
WORLD_CHANGING = (job_state.Reforming, job_state.WaitingForHosts)


class Supervisor:
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
        self.links: list[AgentLink] = []
        self._pids: dict[int, int] = {}
        self._exits: dict[int, dict[str, Any]] = {}
        self.state: job_state.State = job_state.Starting()
        self._failures: list[Failure] = []  # every failure heard of (report: earliest first)
        # The SIGINTs (Ctrl-C) and SIGTERMs received, in order (the signal handler only notes)
        self._interrupts: list[signal.Signals] = []
        self._interruption: Interruption | None = None  # how the ranks ended after the first
        self._started_at = time.monotonic()
        self.output = RankOutput(options, self.out, self.err, on_result)
        self.pool = ElasticPool(options, self)
        self._poller: discovery.Poller | None = None
        self._run_env: dict[str, Any] = {}

    # ---- what the pool asks of the job (elastic_hosts.Job) -----------------------------------

    def ending(self) -> bool:
        return job_state.stopping(self.state) or bool(self._interrupts)

    def started(self, rank: int) -> bool:
        return rank in self._pids

    def exited(self, rank: int) -> bool:
        return rank in self._exits

    def _failure(self) -> Failure | None:
        """The failure acted on (the first heard of); None while none was."""
        return self.state.failure if isinstance(self.state, job_state.Stopping) else None

    def _apply(self, event: job_state.Event) -> None:
        """Move the job's state by ``event`` and carry out what the decision says."""
        decision = job_state.on(self.state, event)
        self.state = decision.state
        for action in decision.actions:
            if action in (job_state.Action.STOP_RANKS, job_state.Action.STOP_RANKS_NOW):
                notice = PEER_NOTICE_S if action is job_state.Action.STOP_RANKS else 0.0
                for lk in self.links:
                    lk.send("stop", notice_s=notice)
            elif action is job_state.Action.FORWARD_SIGNAL:
                # The first signal's own: Ctrl-C reaches the ranks as SIGINT (KeyboardInterrupt),
                # a SIGTERM (Slurm, Kubernetes) as SIGTERM, as torchrun and mpirun forward them.
                sig = self._interrupts[0].name
                grace = self._grace_period_s()
                self._interruption = Interruption(sig, grace)
                what = "interrupted" if sig == "SIGINT" else f"terminated ({sig})"
                self.say(
                    f"{what}: forwarding {sig} to every rank; they have {grace:g} s to exit "
                    "(--grace-period), then are killed (again to kill them at once)"
                )
                for lk in self.links:
                    lk.send("signal", sig=sig)
            elif action is job_state.Action.KILL_RANKS:
                if self._interruption is not None and len(self._interrupts) > 1:
                    self._interruption.at_once = True
                for lk in self.links:
                    lk.send("kill")
            elif action is job_state.Action.KILL_AGENTS:
                self.log("ranks did not stop in time; killing their agents")
                for lk in self.links:
                    lk.kill()
        if decision.timed_out is not None:
            self._fail(self.pool.below_timeout(decision.timed_out))

    def _changed(self, change: Change) -> None:
        """Carry an elastic change into the job's state."""
        if change.failed is not None:
            self._fail(change.failed)
            return
        if change.reformed:
            m = self.pool.membership
            self._apply(job_state.WorldChanged(m.generation if m is not None else 0))
        if change.waiting is not None:
            self._apply(job_state.BelowMinNp(time.monotonic(), change.waiting))

    # ---- public ------------------------------------------------------------------------------

    def run(self) -> int:
        prior = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_sigint)
            signal.signal(signal.SIGTERM, self._on_sigint)  # forwarded as SIGTERM, exit 143
        server = None
        try:
            self.log(f"job {self.job_id}: {describe(self.specs)}")
            unused = horovod_unused(self.env)
            if unused:
                self.log(
                    "accepted without effect here: "
                    + "; ".join(f"{var} ({why})" for var, why in unused)
                )
            server = RendezvousServer(
                self.options.python,
                float(self.options.settings.get("timeout_s") or 300.0),
                self.options.start_timeout_s,
            )
            if self.options.discovery_script:
                self._hosts, self.specs = self.pool.first_discovery()
            self.pool.begin(self.specs, server)
            self._start_agents()
            self._await_hellos()
            self._start_ranks(server.chosen_port)
            self._check_server(server)
            self._apply(job_state.Started())
            if self.options.discovery_script:
                self._poller = discovery.Poller(
                    self.options.discovery_script,
                    self.options.slots_per_host,
                    lambda found: self._events.put((None, {"t": "hosts", "found": found})),
                )
                self._poller.start()
            self._supervise()
        except LaunchError as e:
            self._handle_interrupts()  # "interrupted while starting" is the interrupt's end
            failure = Failure(None, "", 1, str(e), [])
            if not self.ending():
                failure.at = time.time()
                self._failures.append(failure)
            self._apply(job_state.Failed(failure, time.monotonic(), 0.0, hard=True))
        except ConfigError as e:
            # Refused before any rank started (_network): the agents are stopped as for a
            # launch error, but nothing failed; the caller reports the refusal (exit 2).
            refused = Failure(None, "", 2, str(e), [])
            self._apply(job_state.Failed(refused, time.monotonic(), 0.0, hard=True))
            raise
        finally:
            if self._poller is not None:
                self._poller.stop()
            for link in self.links:
                link.close_input()
            self._drain(deadline=time.monotonic() + self.options.grace_s + 2.0)
            # An agent that reported done exits on its closed input: waited for, it is gone from
            # its host when run returns. One that did not (lost, hung) is killed at once.
            ends = time.monotonic() + AGENT_EXIT_S
            for link in self.links:
                link.end(ends if link.done else 0.0)
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

    def is_local(self) -> bool:
        return all(h.is_local for h in self._hosts)

    def _check_server(self, server: RendezvousServer) -> None:
        if server.port != server.chosen_port:  # pragma: no cover - the server binds what it's told
            raise LaunchError(
                f"the rendezvous store bound port {server.port}, not {server.chosen_port}"
            )

    def _start_agents(self) -> None:
        for host in self._hosts_in_use():
            link = self.start_agent(host)
            link.ranks = [s.rank for s in self.specs if s.host == host.name]

    def start_agent(self, host: Host) -> AgentLink:
        argv = agent_start.command_for(
            host,
            self.options.ssh,
            self.options.python,
            os.getcwd(),
            # Enclave jobs look up only the named interfaces (enclaves lack netlink).
            not job_network.enclave_ready(self.options.settings),
            network.spec_names(str(self.options.settings.get("network_interface") or "")),
        )
        self.log(f"agent on {host.name}: {' '.join(argv)}")
        try:
            link = AgentLink(len(self.links), host, argv, self._events)
        except OSError as e:
            raise LaunchError(f"cannot start the agent for host {host.name}: {e}") from e
        self.links.append(link)
        return link

    def _await_hellos(self) -> None:
        deadline = time.monotonic() + self.options.start_timeout_s
        while any(link.hello is None for link in self.links):
            if self._interrupts:
                raise LaunchError("interrupted while starting")
            try:
                link, msg = self._events.get(
                    timeout=max(0.0, min(0.1, deadline - time.monotonic()))
                )
            except queue.Empty:
                if time.monotonic() >= deadline:
                    missing = [lk for lk in self.links if lk.hello is None]
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
        # The settings as the ranks will read them: -x values too (RINGTRAIN_SECURE=1 by -x
        # needs a key the launcher makes, as --secure does).
        ranks_see = {**self.env, **rank_env.explicit(self.env, self.options.forward_env)}
        config = Config.from_env(ranks_see, **self.options.settings)
        key = secrets.token_bytes(32).hex() if _makes_key(config, self.options.settings) else None
        # Kept for ranks started later on hosts a discovery script adds.
        self._run_env = {
            "rdzv": rank_env.Rendezvous(addr, port, self.job_id),
            "settings": to_env(**self.options.settings),
            "key": key,
            # The agents kill a silent rank that did no work this long: the job's setting, as
            # its flag or RINGTRAIN_FROZEN_AFTER_S gave it (checked before any rank started).
            "frozen_s": config.frozen_after_s,
            "grace_s": config.grace_period_s,
        }
        by_host: dict[str, list[ProcessSpec]] = {}
        for s in self.specs:
            by_host.setdefault(s.host, []).append(s)
        for link in self.links:
            specs = by_host[link.host.name]
            self.launch(link, specs, [s.rank for s in specs], host_env.get(link.host.name, {}))
        self._started_at = time.monotonic()

    def launch(
        self,
        link: AgentLink,
        specs: list[ProcessSpec],
        identities: list[int],
        host_net: dict[str, str],
        join: bool = False,
        beside: int = 0,
    ) -> None:
        """Start ``specs`` on ``link``'s host; ``identities`` are their elastic identities;
        ``beside``: the job's ranks already running there, which they join (launch.tuning)."""
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
            self.options.bind_to,
            self.options.malloc,
            {**self.env, **base},
            beside,
        )
        ranks = []
        # The user's own GLOO_/NCCL_ interface variables win over what ringtrain chose.
        net = {
            k: v for k, v in host_net.items() if k.startswith(environ.PREFIX) or k not in self.env
        }
        for s, ident, t in zip(specs, identities, tunings):
            env = {**base, **self._run_env["settings"], **net, **t.env}
            env.update(rank_env.placement(s, self._run_env["rdzv"]))
            if (o := self.options).elastic:
                env.update(
                    elastic.rank_env(ident, o.elastic_timeout_s, o.reset_limit, join, o.fewest)
                )
            ranks.append(
                {
                    "rank": ident,
                    "argv": list(s.argv),
                    "env": env,
                    "cpus": list(t.cpus) if t.cpus else None,
                }
            )
            self.log(f"rank {ident} on {link.host.name}: {t.summary}")
        link.send(
            "start",
            ranks=ranks,
            cwd=os.getcwd(),
            key=self._run_env["key"],
            grace_s=self.options.grace_s,
            frozen_s=self._run_env["frozen_s"],
        )

    def _network(self) -> tuple[str, dict[str, dict[str, str]]]:
        """The rendezvous address every host can reach, and per-host interface variables."""
        iface = job_network.named_interface(self.options, self.env)
        if iface.strip():
            try:
                job_network.check_interface(iface, self.links, self.options.settings)
            except LaunchError as e:
                # A setting no host can honour, found before any rank starts: refused as the
                # launcher's other checks are (exit 2), not reported as a failed job.
                raise ConfigError(str(e)) from None
        if self.is_local():
            return "127.0.0.1", {}
        return job_network.plan(self.links, iface, self.options)

    def _supervise(self) -> None:
        while not all(lk.done or lk.lost for lk in self.links):
            self._handle_interrupts()
            now = time.monotonic()
            self._apply(job_state.Tick(now, self.options.elastic_timeout_s))
            if self.pool.tick(now):
                self._changed(Change(reformed=True))
            if isinstance(self.state, WORLD_CHANGING) and self.pool.whole():
                self._apply(job_state.Settled())
            try:
                link, msg = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            self._handle(link, msg)

    def _drain(self, deadline: float) -> None:
        while not all(lk.done or lk.lost for lk in self.links) and time.monotonic() < deadline:
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
                self._changed(self.pool.discovered(msg["found"]))
            return
        if kind == "out":
            self.output.print_line(
                msg["rank"], msg["fd"], msg["line"], msg.get("end", "\n"), msg.get("received_at")
            )
        elif kind == "hello" and link.joining and link.hello is None:
            self.pool.joiner_hello(link, msg)
        elif kind == "started":
            self._pids[msg["rank"]] = msg["pid"]
            self.output.started(msg["rank"])
        elif kind == "note":
            self.say(f"host {link.host.name}: {msg['line']}")
        elif kind == "stopping":  # on a preemption, at a step saved: its exit follows
            self.pool.stopping[msg["rank"]] = (msg["at"][0], msg["at"][1])
        elif kind == "exit":
            self._on_exit(link, msg)
        elif kind == "done":
            link.done = True
        elif kind == "eof" and not link.done:
            link.lost = True
            if self.ending():
                return
            alive = [r for r in link.ranks if r in self.pool.running()]
            if not alive:
                return
            desc = (
                f"lost the connection to host {link.host.name}'s agent "
                f"(ranks {', '.join(str(r) for r in link.ranks)})"
            )
            if all(r in self.pool.joiners for r in alive):
                if link.err_tail:  # e.g. ssh's reason: the failure is reported only in one line
                    desc += f": {link.err_tail[-1]}"
                self.pool.joiner_failed(link, alive, desc)
                return
            failure = Failure(None, link.host.name, 1, desc, list(link.err_tail))
            if self.pool.membership is not None:
                self._changed(self.pool.lost(desc, link.host.name, failure, *alive))
                return
            self._fail(failure)

    def _on_exit(self, link: AgentLink, msg: dict[str, Any]) -> None:
        rank = msg["rank"]
        self._exits[rank] = msg
        if self._interruption is not None:
            self._interruption.ended(msg)
        self._record_exit(msg)
        pid = self._pids.get(rank)
        step = decide(
            RankExit(
                succeeded=msg.get("code") == 0 and msg.get("signal") is None,
                retired=rank in self.pool.retired,
                interrupted=bool(self._interrupts),
                job_failed=self._failure() is not None,
                stopped_by_launcher=bool(msg.get("stopped")),
                said_failing=bool(msg.get("failing")),
                preempted=preempted(msg),
                joining=rank in self.pool.joiners,
                elastic=self.pool.membership is not None,
                started=pid is not None,
            )
        )
        if step is Next.STOPPED:
            self.log(f"rank {rank} (host {link.host.name}) stopped")
            return
        if step is Next.FINISHED:
            self.pool.finishing()  # the job is finishing: no new ranks
            # Kept for the report: where the peers fail only because a rank left (os._exit(0),
            # a script that ran fewer collectives), that rank left first (failures.py).
            finish = self._exit_failure(link.host.name, msg, pid)
            finish.finished = True
            self._failures.append(finish)
            return
        if step is Next.IGNORE:
            return
        failure = self._exit_failure(link.host.name, msg, pid)
        if step is Next.ALSO_FAILED:
            self._failures.append(failure)
        elif step is Next.JOINER_FAILED:
            self.pool.joiner_failed(link, [rank], failure.description)
        elif step is Next.REFORM:
            self._changed(self.pool.lost(failure.description, link.host.name, failure, rank))
        else:
            self._fail(failure)

    def _record_exit(self, msg: dict[str, Any]) -> None:
        """Tell the peers how a rank's process ended (its code, which a rank that called
        ``sys.exit(n)`` cannot post itself), before any rank is stopped. Elastic ranks are
        renumbered as worlds change, so only a fixed world's ranks are recorded."""
        server = self.pool.server
        if server is None or self.pool.membership is not None:
            return
        with contextlib.suppress(LaunchError):  # the store is gone: nobody left to tell
            server.publish(exited_key(msg["rank"]), recorded_end(msg, self._interruption))

    def _exit_failure(self, host: str, msg: dict[str, Any], pid: int | None) -> Failure:
        return exit_failure(host, msg, pid, time.monotonic() - self._started_at)

    def _fail(self, failure: Failure) -> None:
        if self._failure() is not None or self._interrupts:
            return
        if not failure.at:
            failure.at = time.time()
        self._failures.append(failure)
        others = len(self.pool.running())
        self.say(acted_on(failure, others))
        # The agents give the peers a notice first, those that said they fail more to end alone.
        grace = PEER_NOTICE_S + self.options.grace_s + FAILING_GRACE_S
        self._apply(job_state.Failed(failure, time.monotonic(), grace))

    def _on_sigint(self, signum: int, _frame: FrameType | None) -> None:
        self._interrupts.append(signal.Signals(signum))  # acted on by the supervising loop

    def _handle_interrupts(self) -> None:
        if self._interrupts:
            now = time.monotonic()
            self._apply(job_state.Interrupted(len(self._interrupts), now, self._grace_period_s()))

    def _grace_period_s(self) -> float:
        """How long ranks get after a forwarded signal: the job's setting, as its flag or
        RINGTRAIN_GRACE_PERIOD_S gave it (checked before any rank started)."""
        return float(self._run_env.get("grace_s", Config.grace_period_s))

    def say(self, text: str) -> None:
        when = stamp() if self.options.timestamp_output else ""
        self.output.end_bar()
        with contextlib.suppress(BrokenPipeError, ValueError):
            self.err.write(f"{when}ringtrain run: {text}\n")
            self.err.flush()

    def log(self, text: str) -> None:
        if self.options.verbose:
            self.say(text)

    def _report(self) -> int:
        code = self._verdict()
        preempted = code != 0 and stopped_on_preemption(self._failures, self._interruption)
        self._apply(job_state.AgentsEnded(code, preempted))
        return code

    def _verdict(self) -> int:
        if all(f.finished for f in self._failures):
            if self._interrupts:
                sig = self._interrupts[0]
                self.say(interrupted_report(sig.name, self._interruption))
                return 128 + int(sig)
            if self.pool.absorbed:
                self.say(survived_report(self.pool.absorbed, len(self._failures)))
            took = time.monotonic() - self._started_at
            self.log(f"all {len(self.specs)} ranks exited 0 in {took:.1f} s")
            return 0
        self.say(report(self._failures, self.pool.absorbed))
        return root_cause(self._failures).code


def _makes_key(config: Config, flags: dict[str, Any]) -> bool:
    """Whether the launcher makes the job key: secure mode (by flag or RINGTRAIN_SECURE) and no
    key file named by flag, nor alongside RINGTRAIN_SECURE (launch/command.check_settings)."""
    if flags.get("key_file"):
        return False
    return config.secure and (bool(flags.get("secure")) or not config.key_file)
