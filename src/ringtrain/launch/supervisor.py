"""The launcher side of a job: agents up, ranks started, output relayed, first failure acted on.

Failure policy (elastic jobs, ``--min-np``/``--max-np``: see :mod:`ringtrain.launch.elastic`): a
rank that fails is dropped and the others told to re-form the world, while at least ``--min-np``
remain. With ``--host-discovery-script`` (:mod:`ringtrain.launch.discovery`) the launcher also
starts ranks on hosts the script offers (up to ``--max-np``), retires those of hosts it no
longer offers, excludes hosts whose ranks failed, and below ``--min-np`` waits up to
``--elastic-timeout`` for new hosts; below that, or without those flags, the policy below
applies.

Failure policy: the first rank that exits non-zero (or is killed by a signal) ends the job. The
others get SIGTERM, then SIGKILL after a grace period; the launcher exits with that rank's code
(128 + signal number for a signal) after a message naming the rank, its host, how it ended and
the last lines of its error output. Ctrl-C is forwarded to every rank as SIGINT; a second Ctrl-C
stops them at once. A host whose agent link breaks counts as a failure of all its ranks.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import IO, Any

from ringtrain import environ
from ringtrain.config import env_var, to_env
from ringtrain.environ import horovod_settings, horovod_unused
from ringtrain.errors import LaunchError
from ringtrain.host import network
from ringtrain.launch import discovery, elastic, protocol, rank_env, transport
from ringtrain.launch.hosts import Host
from ringtrain.launch.options import LaunchOptions
from ringtrain.launch.plan import ProcessSpec, describe, plan
from ringtrain.launch.rendezvous import RendezvousServer
from ringtrain.launch.tuning import HostFacts, tune

AGENT_ERR_LINES = 20


@dataclass
class Failure:
    rank: int | None
    host: str
    code: int
    description: str
    tail: list[str]


class AgentLink:
    """One host's agent process (local or ssh) and the thread that reads its messages."""

    def __init__(self, index: int, host: Host, argv: list[str], events: queue.Queue[Any]) -> None:
        self.index = index
        self.host = host
        self.argv = argv
        self.hello: dict[str, Any] | None = None
        self.done = False
        self.lost = False
        self.ranks: list[int] = []  # identities of the ranks this agent runs
        self.joining = False  # started for a running elastic job; its ranks join when ready
        self.err_tail: collections.deque[str] = collections.deque(maxlen=AGENT_ERR_LINES)
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # Ctrl-C goes to the launcher, which forwards it on purpose
        )
        self._events = events
        self._err_reader = threading.Thread(target=self._read_err, daemon=True)
        self._err_reader.start()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = protocol.parse(line)
            if msg is not None:
                self._events.put((self, msg))
        self.proc.wait()
        # The eof report quotes err_tail (ssh's own words), so wait for stderr to drain too; a
        # grandchild holding stderr open must not hold the report up for long.
        self._err_reader.join(timeout=2.0)
        self._events.put((self, {"t": "eof"}))

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err_tail.append(line.rstrip("\n"))

    def send(self, kind: str, **fields: Any) -> None:
        if self.proc.stdin is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            protocol.send(self.proc.stdin, kind, **fields)

    def close_input(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


class Supervisor:
    """Runs one job to completion; :meth:`run` returns the launcher's exit code."""

    def __init__(
        self,
        options: LaunchOptions,
        env: Mapping[str, str] | None = None,
        out: IO[str] | None = None,
        err: IO[str] | None = None,
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
        self._failure: Failure | None = None
        self._interrupts = 0
        self._stop_deadline: float | None = None
        self._started_at = time.monotonic()
        self._outputs: dict[tuple[int, int], IO[str]] = {}
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
            for f in self._outputs.values():
                f.close()
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
            self._list_interfaces(),
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
                        self._unreachable(
                            missing, f"did not answer within {self.options.start_timeout_s:.0f} s"
                        )
                    )
                continue
            if msg["t"] == "hello":
                link.hello = msg
            elif msg["t"] == "eof":
                raise LaunchError(self._unreachable([link], "exited before it started"))

    def _unreachable(self, links: list[AgentLink], what: str) -> str:
        lines = []
        for lk in links:
            detail = "\n    ".join(lk.err_tail) or "(no output)"
            lines.append(f"the agent on host {lk.host.name} {what}:\n    {detail}")
        hint = (
            "HINT: check `ssh HOST true` works without a password prompt (BatchMode), that the "
            "host key is known, and that ringtrain is installed at the same path on every host; "
            "`ringtrain doctor -H ...` checks all of this."
        )
        return "\n".join([*lines, hint])

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

    def _list_interfaces(self) -> bool:
        """Secure mode or the TCP transport, with an explicit interface, enumerate nothing
        (enclaves lack netlink)."""
        return not self._enclave_ready()

    def _enclave_ready(self) -> bool:
        settings = self.options.settings
        enclave = settings.get("secure") or settings.get("transport") == "tcp"
        return bool(enclave and settings.get("network_interface"))

    def _network(self) -> tuple[str, dict[str, dict[str, str]]]:
        """The rendezvous address every host can reach, and per-host interface variables."""
        iface = str(
            self.options.settings.get("network_interface")
            or self.env.get(env_var("network_interface"), "")
            or horovod_settings(self.env).get("network_interface", "")  # HOROVOD_GLOO_IFACE
        )
        if iface.strip():
            self._check_interface(iface)
        if self._is_local():
            return "127.0.0.1", {}
        return network.plan_network(
            {lk.host.name: lk.hello.get("interfaces", []) for lk in self._links if lk.hello},
            iface,
            secure=self._enclave_ready(),
            candidates=self.options.interface_candidates,
        )

    def _check_interface(self, iface: str) -> None:
        """A ``--network-interface`` some host lacks fails here, once, from what the agents
        reported, rather than in every rank's Gloo. Agents of enclave jobs look the named
        interfaces up one by one (no enumeration): one they did not report has no IPv4 address
        on that host."""
        chosen = network.resolve_spec(iface, self._reported_interfaces())
        missing = sorted(h for h, i in chosen.items() if not i.address)
        if self._enclave_ready() and missing:
            raise LaunchError(
                f"--network-interface {iface!r}: no interface of that name has an IPv4 address "
                f"on {', '.join(missing)}.\nHINT: check the name with `ip -4 addr` on each "
                "host, or pass HOST=NAME for hosts whose interface is named differently."
            )

    def _reported_interfaces(self) -> dict[str, list[network.Interface]]:
        return {
            lk.host.name: [network.Interface.from_dict(i) for i in lk.hello.get("interfaces", [])]
            for lk in self._links
            if lk.hello
        }

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
            self._print_line(msg["rank"], msg["fd"], msg["line"], msg.get("end", "\n"))
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
        code, sig = msg.get("code"), msg.get("signal")
        if rank in self._retired:
            self._log(f"rank {rank} (host {link.host.name}) stopped")
            return
        if code == 0 and sig is None:
            if self._growing and self._membership is not None and self._joiners:
                self._retire_joiners("a rank finished")
            self._growing = False  # the job is finishing: no new ranks
            return
        if self._failure is not None or self._interrupts:
            return  # stopped by us after the first failure, or by Ctrl-C
        if msg.get("silent_s") is not None:
            how = f"stopped responding (no heartbeat for {msg['silent_s']:.1f} s) and was killed"
            exit_code = 128 + int(signal.SIGKILL)
        elif sig is not None:
            signum = int(signal.Signals[sig])
            how, exit_code = f"was killed by {sig}", 128 + signum
        else:
            how, exit_code = f"exited with code {code}", int(code or 1)
        pid = self._pids.get(rank)
        tail = list(msg.get("tail") or [])
        if pid is None:  # the agent could not even start the command
            desc = (
                f"rank {rank} (host {link.host.name}) could not start: {tail[-1] if tail else how}"
            )
        else:
            elapsed = time.monotonic() - self._started_at
            desc = f"rank {rank} (host {link.host.name}, pid {pid}) {how} after {elapsed:.1f} s"
        if rank in self._joiners:
            self._joiner_failed(link, [rank], desc)
            return
        if self._membership is not None and pid is not None:
            self._exclude(link.host.name, desc)
            if self._reform(desc, rank):
                return
            failure = Failure(rank, link.host.name, exit_code, desc, tail)
            if self._await_hosts(desc, failure):
                return
            desc += self._shortfall()
        self._fail(Failure(rank, link.host.name, exit_code, desc, tail))

    def _reform(self, desc: str, *ranks: int) -> bool:
        """Elastic: drop ``ranks`` and announce the survivors' world. False below --min-np."""
        m = self._membership
        assert m is not None and self._server is not None
        self._left.append(desc)
        if not m.lose(*ranks):
            return False
        if not m.members:
            return False
        self._announce()
        self._say(
            f"{desc}; re-forming the world with the {len(m.members)} remaining rank(s) "
            f"{m.members} (generation {m.generation})"
        )
        return True

    def _shortfall(self) -> str:
        """What is missing when the job ends below --min-np without waiting for hosts."""
        m = self._membership
        assert m is not None
        where = ", ".join(f"{i} on {self._rank_host[i]}" for i in m.members) or "none"
        why = (
            "no rank remains to carry the state"
            if not m.members
            else "no --host-discovery-script can add hosts"
        )
        return (
            f"; fewer than --min-np {m.min_np} ranks remain ({len(m.members)} left: rank(s) "
            f"{where}; {m.min_np - len(m.members)} more needed; {why})"
        )

    def _announce(self) -> None:
        m = self._membership
        assert m is not None and self._server is not None
        for key, value in m.announcement():
            self._server.publish(key, value)

    def _fail(self, failure: Failure) -> None:
        self._failure = failure
        others = len(
            [r for r in self._rank_host if r not in self._exits and r not in self._retired]
        )
        self._say(f"{failure.description}; stopping the other {others} rank(s).")
        self._stop_all(hard=False)

    # ---- elastic hosts (--host-discovery-script) -----------------------------------------------

    def _first_discovery(self) -> None:
        """Plan the first world on the hosts the script offers, waiting up to --elastic-timeout
        for at least --min-np slots. A script that fails here is a configuration error."""
        o = self.options
        assert o.discovery_script is not None
        min_np = o.min_np if o.min_np is not None else o.np
        deadline = time.monotonic() + o.elastic_timeout_s
        while True:
            hosts = discovery.run_script(o.discovery_script, o.slots_per_host)
            capacity = sum(h.slots for h in hosts)
            if capacity >= min_np and hosts:
                break
            if time.monotonic() > deadline or self._interrupts:
                raise LaunchError(
                    f"timed out after {o.elastic_timeout_s:g} s (--elastic-timeout) waiting for "
                    f"--min-np {min_np} slots: the discovery script offers {capacity} "
                    f"({_listed(hosts)})"
                )
            time.sleep(discovery.EVERY_S)
        if any(h.is_local for h in hosts) and not all(h.is_local for h in hosts):
            raise LaunchError(
                f"the discovery script offers local and remote hosts ({_listed(hosts)}).\n"
                "HINT: name this machine by an address the other hosts can reach."
            )
        self._hosts = hosts
        self._offered = hosts
        self.specs = plan(min(o.np, capacity), hosts, o.command, o.placement)

    def _on_discovered(self, found: list[Host] | LaunchError) -> None:
        if isinstance(found, LaunchError):
            self._say(f"{found} (keeping the hosts found before; trying again)")
            return
        if self._failure is not None or self._interrupts or self._membership is None:
            return
        self._offered = found
        offered = {h.name for h in found}
        gone = [
            i
            for i, host in self._rank_host.items()
            if host not in offered and i not in self._exits and i not in self._retired
        ]
        if gone:
            self._remove_hosts(gone)
        self._grow()

    def _remove_hosts(self, gone: list[int]) -> None:
        """Ranks on hosts the script no longer offers leave the world; then they are stopped."""
        m = self._membership
        assert m is not None
        hosts = sorted({self._rank_host[i] for i in gone})
        desc = (
            f"host(s) {', '.join(hosts)} no longer offered by the discovery script: "
            f"removing rank(s) {gone}"
        )
        members = [i for i in gone if i in m.members]
        for i in gone:
            self._joiners.pop(i, None)
        self._retired.update(gone)
        for lk in self._links:
            if lk.host.name in hosts:
                self._stop_link(lk)
        if not members:
            self._say(desc)
        elif not self._reform(desc, *members):
            failure = Failure(None, hosts[0], 1, desc, [])
            if not self._await_hosts(desc, failure):
                self._fail(
                    Failure(None, hosts[0], 1, desc + "; no rank remains to carry the state", [])
                )

    def _grow(self) -> None:
        """Start ranks on offered slots that have none, up to --max-np."""
        m = self._membership
        if not self._growing or m is None or self._failure is not None or self._interrupts:
            return
        live = [*m.members, *self._joiners]
        per_host = collections.Counter(self._rank_host[i] for i in live)
        limit = self.options.max_np if self.options.max_np is not None else float("inf")
        total = len(live)
        for host in self._offered:
            free = host.slots - per_host[host.name]
            n = int(min(free, limit - total))
            if n <= 0 or self._exclusions.excluded(host.name):
                continue
            if host.is_local != self._is_local():
                continue  # refused once, at the first discovery, with its reason
            self._start_joiners(host, n)
            total += n

    def _start_joiners(self, host: Host, n: int) -> None:
        ids = list(range(max(self._rank_host) + 1, max(self._rank_host) + 1 + n))
        ready_by = (
            time.monotonic()
            + max(self.options.start_timeout_s, 0.0)
            + (self.options.elastic_timeout_s)
        )
        for i in ids:
            self._rank_host[i] = host.name
            self._joiners[i] = ready_by
        self._say(f"host {host.name} offers {n} free slot(s): starting rank(s) {ids} to join")
        try:
            link = self._start_agent(host)
        except LaunchError as e:
            for i in ids:
                self._joiners.pop(i, None)
                self._retired.add(i)
            self._exclude(host.name, str(e))
            return
        link.ranks = ids
        link.joining = True

    def _on_joiner_hello(self, link: AgentLink, msg: dict[str, Any]) -> None:
        link.hello = msg
        m = self._membership
        ids = [i for i in link.ranks if i in self._joiners]
        if m is None or not ids or not self._growing or self._failure is not None:
            self._stop_link(link)
            return
        host_net: dict[str, str] = {}
        if not self._is_local():
            try:
                _, host_env = network.plan_network(
                    {
                        lk.host.name: lk.hello.get("interfaces", [])
                        for lk in self._links
                        if lk.hello
                    },
                    str(self.options.settings.get("network_interface") or ""),
                    secure=self._enclave_ready(),
                    candidates=self.options.interface_candidates,
                )
                host_net = host_env.get(link.host.name, {})
            except LaunchError as e:
                self._joiner_failed(link, ids, f"host {link.host.name}: {e}")
                return
        size = len(m.members) + len(self._joiners)
        first = len(m.members) + list(self._joiners).index(ids[0])
        specs = [
            ProcessSpec(
                rank=first + j,
                size=size,
                host=link.host.name,
                host_index=link.index,
                local_rank=j,
                local_size=len(ids),
                cross_rank=0,
                cross_size=1,
                argv=tuple(self.options.command),
            )
            for j in range(len(ids))
        ]
        shared = any(
            lk is not link and lk.host.name == link.host.name and not (lk.done or lk.lost)
            for lk in self._links
        )
        self._launch(link, specs, ids, host_net, join=True, bind_to="none" if shared else None)

    def _elastic_tick(self) -> None:
        """Announce joiners that are ready; give up on late ones; end a too long wait."""
        now = time.monotonic()
        if now < self._next_check or self._failure is not None or self._interrupts:
            return
        self._next_check = now + 0.25
        m = self._membership
        assert m is not None and self._server is not None
        if self._below is not None and now - self._below[0] > self.options.elastic_timeout_s:
            self._fail(self._below_timeout(self._below[1]))
            return
        for lk in self._links:
            late = [i for i in lk.ranks if i in self._joiners and self._joiners[i] < now]
            if late:
                self._joiner_failed(
                    lk, late, f"rank(s) {late} on host {lk.host.name} were not ready in time"
                )
        waiting = [i for i in self._joiners if i in self._pids]
        if not waiting:
            return
        have = self._server.present([elastic.ready_key(i) for i in waiting])
        # A host's new ranks join together, in one new world.
        ready: list[int] = []
        for lk in self._links:
            ids = [i for i in lk.ranks if i in self._joiners]
            if ids and all(elastic.ready_key(i) in have for i in ids):
                ready += ids
        if not ready or len(m.members) + len(ready) < m.min_np:
            return
        hosts = sorted({self._rank_host[i] for i in ready})
        for i in ready:
            del self._joiners[i]
        m.add(*ready)
        self._announce()
        self._below = None
        self._say(
            f"rank(s) {ready} on host(s) {', '.join(hosts)} ready: growing the world to "
            f"{len(m.members)} rank(s) {m.members} (generation {m.generation})"
        )

    def _joiner_failed(self, link: AgentLink, ids: list[int], desc: str) -> None:
        """A rank started to join failed before it joined: its host is excluded, the job goes
        on. Its agent's other joiners are stopped with it."""
        for i in link.ranks:
            if i in self._joiners:
                del self._joiners[i]
                self._retired.add(i)
        self._stop_link(link)
        self._exclude(link.host.name, desc)

    def _retire_joiners(self, why: str) -> None:
        ids = list(self._joiners)
        self._joiners.clear()
        self._retired.update(ids)
        for lk in self._links:
            if any(i in ids for i in lk.ranks):
                self._stop_link(lk)
        self._log(f"{why}: stopping rank(s) {ids} that had not joined yet")

    def _stop_link(self, link: AgentLink) -> None:
        """Stop an agent's ranks. One that started none ends by closing its input (it reports
        "done" only after ranks it ran), so the job does not wait for it."""
        if any(r in self._pids for r in link.ranks):
            link.send("stop")
        else:
            link.close_input()

    def _exclude(self, host: str, why: str) -> None:
        """Horovod's blacklist: no new rank starts on ``host`` for a cool-down. Only a discovery
        script can offer a host again, so only then is it said."""
        if not self.options.discovery_script:
            return
        cooldown = self._exclusions.fail(host)
        n = self._exclusions.failures(host)
        if cooldown is None:
            span = "for the rest of the job (--blacklist-cooldown-range MIN MAX lets it back)"
        else:
            span = f"for {cooldown:.1f} s"
        self._say(f"excluding host {host} {span} after failure {n} of its ranks: {why}")

    def _await_hosts(self, desc: str, failure: Failure) -> bool:
        """Below --min-np with a discovery script: wait up to --elastic-timeout for hosts."""
        m = self._membership
        if not self.options.discovery_script or m is None or not m.members:
            return False
        if self._below is None:
            self._below = (time.monotonic(), failure)
        self._say(
            f"{desc}; {len(m.members)} rank(s) remain, fewer than --min-np {m.min_np}: waiting "
            f"up to {self.options.elastic_timeout_s:g} s (--elastic-timeout) for the discovery "
            "script to offer hosts"
        )
        self._grow()
        return True

    def _below_timeout(self, first: Failure) -> Failure:
        m = self._membership
        assert m is not None
        where = ", ".join(f"{i} on {self._rank_host[i]}" for i in m.members)
        excluded = []
        for name in dict.fromkeys(self._rank_host.values()):
            left = self._exclusions.remaining_s(name)
            if left is not None:
                excluded.append(
                    f"{name} ({'for good' if left == float('inf') else f'{left:.0f} s more'})"
                )
        lines = [
            f"fewer than --min-np {m.min_np} ranks for {self.options.elastic_timeout_s:g} s "
            f"(--elastic-timeout): {len(m.members)} remain (rank(s) {where}), "
            f"{m.min_np - len(m.members)} more needed",
            *(f"  left: {d}" for d in self._left),
            f"  excluded hosts: {', '.join(excluded) or 'none'}",
            f"  the discovery script offers: {_listed(self._offered)}",
        ]
        return Failure(first.rank, first.host, first.code, "\n".join(lines), first.tail)

    def _send_stop(self) -> None:
        for lk in self._links:
            lk.send("stop")

    def _stop_all(self, hard: bool) -> None:
        self._send_stop()
        grace = 0.0 if hard else self.options.grace_s
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

    # ---- output ------------------------------------------------------------------------------

    def _print_line(self, rank: int, fd: int, line: str, end: str) -> None:
        if self.options.output_dir:
            self._output_file(rank, fd).write(line + end)
        stream = self.out if fd == 1 else self.err
        text = f"[{rank}] {line}" if self.options.prefix_output else line
        with contextlib.suppress(BrokenPipeError, ValueError):
            stream.write(text + end)
            stream.flush()

    def _output_file(self, rank: int, fd: int) -> IO[str]:
        """--output-filename DIR: DIR/rank.<rank>/stdout|stderr, as horovodrun lays them out
        (ranks zero-padded to the width of the largest, so they sort in order)."""
        f = self._outputs.get((rank, fd))
        if f is None:
            assert self.options.output_dir is not None
            width = len(str(self.options.np - 1))
            folder = os.path.join(self.options.output_dir, f"rank.{rank:0{width}d}")
            try:
                os.makedirs(folder, exist_ok=True)
                f = open(  # noqa: SIM115 (closed when the job ends)
                    os.path.join(folder, "stdout" if fd == 1 else "stderr"),
                    "w",
                    buffering=1,
                )
            except OSError as e:
                raise LaunchError(f"--output-filename: cannot write {folder}: {e}") from None
            self._outputs[(rank, fd)] = f
        return f

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
        lines = [f"job failed: {f.description}"]
        if f.tail:
            who = f"rank {f.rank}" if f.rank is not None else f"host {f.host}"
            lines.append(f"last lines of {who}'s error output:")
            lines.extend(f"  | {t}" for t in f.tail)
        self._say("\n".join(lines))
        return f.code


def _listed(hosts: list[Host]) -> str:
    return ", ".join(f"{h.name}:{h.slots}" for h in hosts) or "no host"
