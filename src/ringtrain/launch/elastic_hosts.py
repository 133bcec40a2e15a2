"""Elastic jobs in the launcher: the world re-formed after a loss, hosts from a discovery script.

With ``--min-np``/``--max-np`` (:mod:`ringtrain.launch.elastic`) a rank that fails is dropped
and the survivors are told their new world, while at least ``--min-np`` remain; a rank whose
collective failed while none left asks, and the same ranks re-form as a new world. With
``--host-discovery-script`` (:mod:`ringtrain.launch.discovery`) the launcher also starts ranks on
hosts the script offers (up to ``--max-np``; a host's new ranks join together once all are
ready), retires those of hosts it no longer offers, excludes hosts whose ranks failed for a
cool-down (Horovod's blacklist), and below ``--min-np`` waits up to ``--elastic-timeout`` for
new hosts. :class:`ElasticPool` owns that state; the supervisor
(:mod:`ringtrain.launch.supervisor`) owns one pool, hands it events, and turns the
:class:`Change` each returns into its job state (:mod:`ringtrain.launch.job_state`).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any, Protocol

from ringtrain.errors import LaunchError
from ringtrain.launch import discovery, elastic, job_network
from ringtrain.launch.agent_link import AgentLink
from ringtrain.launch.failures import Failure
from ringtrain.launch.hosts import Host
from ringtrain.launch.options import LaunchOptions
from ringtrain.launch.plan import ProcessSpec, plan
from ringtrain.launch.rendezvous import RendezvousServer


@dataclass(frozen=True)
class Change:
    """What an elastic event did to the job, for the supervisor's state (see
    :mod:`ringtrain.launch.job_state`)."""

    reformed: bool = False  # a new world was announced, or ranks started to join one
    waiting: Failure | None = None  # below --min-np, waiting for hosts since this failure
    failed: Failure | None = None  # the job fails with this


class Job(Protocol):
    """What the pool asks of the job it serves (the supervisor)."""

    links: list[AgentLink]

    def say(self, text: str) -> None: ...
    def log(self, text: str) -> None: ...
    def ending(self) -> bool: ...  # a failure was acted on, or Ctrl-C
    def started(self, rank: int) -> bool: ...  # its agent reported its pid
    def exited(self, rank: int) -> bool: ...
    def is_local(self) -> bool: ...
    def start_agent(self, host: Host) -> AgentLink: ...
    def launch(
        self,
        link: AgentLink,
        specs: list[ProcessSpec],
        identities: list[int],
        host_net: dict[str, str],
        join: bool = False,
        beside: int = 0,
    ) -> None: ...


class ElasticPool:
    """Who runs where, who is in the world, and the hosts a discovery script offers. The
    supervisor owns one; the pool reaches the job only through :class:`Job`."""

    def __init__(self, options: LaunchOptions, job: Job) -> None:
        self.options = options
        self.job = job
        self.server: RendezvousServer | None = None  # set once the store runs
        self.membership: elastic.Membership | None = None  # elastic jobs only
        self.exclusions = discovery.Exclusions(options.cooldown_range)
        self.offered: list[Host] = []
        self.rank_host: dict[int, str] = {}  # every rank ever started: identity -> host
        self.joiners: dict[int, float] = {}  # started, not yet in a world: id -> ready by
        self.retired: set[int] = set()  # stopped on purpose (host no longer offered)
        self.left: list[str] = []  # how each rank that left the world went
        self.absorbed: list[Failure] = []  # failures the job went on without (report())
        # Ranks that said they stop on a preemption: (step, world) saved; their exits follow.
        self.stopping: dict[int, tuple[int, int]] = {}
        self.growing = True  # until a rank finishes
        self.requests = elastic.ReformRequests()
        self._next_check = 0.0

    def begin(self, specs: list[ProcessSpec], server: RendezvousServer) -> None:
        """The first world: ``specs`` are about to start, the store is ``server``."""
        self.server = server
        self.rank_host = {s.rank: s.host for s in specs}
        if self.options.elastic:
            self.membership = elastic.Membership([s.rank for s in specs], self.options.fewest)

    def running(self) -> list[int]:
        """Ranks started and neither exited nor retired."""
        return [r for r in self.rank_host if not self.job.exited(r) and r not in self.retired]

    def whole(self) -> bool:
        """No rank waits to join and at least --min-np are in the world."""
        m = self.membership
        return not self.joiners and (m is None or len(m.members) >= m.min_np)

    # ---- the world after a loss -----------------------------------------------------------------

    def lost(self, desc: str, host: str, failure: Failure, *ranks: int) -> Change:
        """Ranks that failed (or a host's, together) leave the world: a new world without
        them, or below --min-np a wait for hosts, or the job fails (naming what is missing).
        A rank that stopped on a preemption takes the ranks that stop at the same step with it:
        one new world, not one per rank as their exits come."""
        m = self.membership
        assert m is not None
        if not any(r in m.members for r in ranks):  # taken out before its exit came
            self.absorbed.append(failure)
            with_ = "with the ranks that stopped at that step" if failure.preempted else "before"
            self.job.say(f"{desc}; it had left the world {with_}")
            return Change()
        together = [
            r for r in m.members
            if r not in ranks and failure.stop is not None and self.stopping.get(r) == failure.stop
        ]  # fmt: skip
        if together:
            desc += f"; rank(s) {', '.join(map(str, together))} stop at that step too"
            ranks = (*ranks, *together)
        if failure.preempted:  # the platform took the host: if the script offers it again, use it
            self._spared(host)
        else:
            self.exclude(host, desc)
        if self._reform(desc, *ranks):
            self.absorbed.append(failure)  # for the report, should the job fail later
            return Change(reformed=True)
        if self._await_hosts(desc):
            self.absorbed.append(failure)
            return Change(waiting=failure)
        failure.description = desc + self._shortfall()  # desc: the failure's, and who went too
        return Change(failed=failure)

    def _reform(self, desc: str, *ranks: int) -> bool:
        """Elastic: drop ``ranks`` and announce the survivors' world. False below --min-np."""
        m = self.membership
        assert m is not None and self.server is not None
        self.left.append(desc)
        if not m.lose(*ranks):
            return False
        if not m.members:
            return False
        self._announce()
        self.job.say(
            f"{desc}; re-forming the world with the {len(m.members)} remaining rank(s) "
            f"{m.members} (generation {m.generation})"
        )
        return True

    def _shortfall(self) -> str:
        """What is missing when the job ends below --min-np without waiting for hosts."""
        m = self.membership
        assert m is not None
        where = ", ".join(f"{i} on {self.rank_host[i]}" for i in m.members) or "none"
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
        m = self.membership
        assert m is not None and self.server is not None
        for key, value in m.announcement():
            self.server.publish(key, value)

    # ---- elastic hosts (--host-discovery-script) -----------------------------------------------

    def first_discovery(self) -> tuple[list[Host], list[ProcessSpec]]:
        """The hosts the script offers and the first world's plan on them, waiting up to
        --elastic-timeout for at least --min-np slots. A script that fails here is a
        configuration error."""
        o = self.options
        assert o.discovery_script is not None
        min_np = o.fewest
        deadline = time.monotonic() + o.elastic_timeout_s
        while True:
            hosts = discovery.run_script(o.discovery_script, o.slots_per_host)
            capacity = sum(h.slots for h in hosts)
            if capacity >= min_np and hosts:
                break
            if time.monotonic() > deadline or self.job.ending():
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
        self.offered = hosts
        return hosts, plan(min(o.np, capacity), hosts, o.command, o.placement)

    def discovered(self, found: list[Host] | LaunchError) -> Change:
        if isinstance(found, LaunchError):
            self.job.say(f"{found} (keeping the hosts found before; trying again)")
            return Change()
        if self.job.ending() or self.membership is None:
            return Change()
        self.offered = found
        offered = {h.name for h in found}
        gone = [i for i in self.running() if self.rank_host[i] not in offered]
        change = self._remove_hosts(gone) if gone else Change()
        if change.failed is None and self._grow():
            return Change(True, change.waiting)
        return change

    def _remove_hosts(self, gone: list[int]) -> Change:
        """Ranks on hosts the script no longer offers leave the world; then they are stopped."""
        m = self.membership
        assert m is not None
        hosts = sorted({self.rank_host[i] for i in gone})
        desc = (
            f"host(s) {', '.join(hosts)} no longer offered by the discovery script: "
            f"removing rank(s) {gone}"
        )
        members = [i for i in gone if i in m.members]
        for i in gone:
            self.joiners.pop(i, None)
        self.retired.update(gone)
        for lk in self.job.links:
            if lk.host.name in hosts:
                self.stop_link(lk)
        if not members:
            self.job.say(desc)
            return Change()
        if self._reform(desc, *members):
            return Change(reformed=True)
        failure = Failure(None, hosts[0], 1, desc, [])
        if self._await_hosts(desc):
            return Change(waiting=failure)
        return Change(
            failed=Failure(None, hosts[0], 1, desc + "; no rank remains to carry the state", [])
        )

    def _grow(self) -> bool:
        """Start ranks on offered slots that have none, up to --max-np; whether any started."""
        m = self.membership
        if not self.growing or m is None or self.job.ending():
            return False
        live = [*m.members, *self.joiners]
        per_host = collections.Counter(self.rank_host[i] for i in live)
        limit = self.options.max_np if self.options.max_np is not None else float("inf")
        total = len(live)
        started = False
        for host in self.offered:
            free = host.slots - per_host[host.name]
            n = int(min(free, limit - total))
            if n <= 0 or self.exclusions.excluded(host.name):
                continue
            if host.is_local != self.job.is_local():
                continue  # refused once, at the first discovery, with its reason
            started = self._start_joiners(host, n) or started
            total += n
        return started

    def _start_joiners(self, host: Host, n: int) -> bool:
        ids = list(range(max(self.rank_host) + 1, max(self.rank_host) + 1 + n))
        ready_by = (
            time.monotonic()
            + max(self.options.start_timeout_s, 0.0)
            + (self.options.elastic_timeout_s)
        )
        for i in ids:
            self.rank_host[i] = host.name
            self.joiners[i] = ready_by
        self.job.say(f"host {host.name} offers {n} free slot(s): starting rank(s) {ids} to join")
        try:
            link = self.job.start_agent(host)
        except LaunchError as e:
            for i in ids:
                self.joiners.pop(i, None)
                self.retired.add(i)
            self.exclude(host.name, str(e))
            return False
        link.ranks = ids
        link.joining = True
        return True

    def joiner_hello(self, link: AgentLink, msg: dict[str, Any]) -> None:
        link.hello = msg
        m = self.membership
        ids = [i for i in link.ranks if i in self.joiners]
        if m is None or not ids or not self.growing or self.job.ending():
            self.stop_link(link)
            return
        host_net: dict[str, str] = {}
        if not self.job.is_local():
            try:
                iface = str(self.options.settings.get("network_interface") or "")
                _, host_env = job_network.plan(self.job.links, iface, self.options)
                host_net = host_env.get(link.host.name, {})
            except LaunchError as e:
                self.joiner_failed(link, ids, f"host {link.host.name}: {e}")
                return
        size = len(m.members) + len(self.joiners)
        first = len(m.members) + list(self.joiners).index(ids[0])
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
        # The job's ranks already on this host hold its cores: the new ones size their threads
        # for all of them (launch.tuning).
        here = link.host.name
        beside = sum(1 for i in self.running() if self.rank_host[i] == here and i not in ids)
        self.job.launch(link, specs, ids, host_net, join=True, beside=beside)

    def tick(self, now: float) -> bool:
        """Re-form the world where a rank asked; give up on late joiners; announce those that
        are ready (a host's new ranks join together, in one new world). Whether a new world
        was announced."""
        if now < self._next_check or self.job.ending() or self.membership is None:
            return False
        self._next_check = now + 0.25
        m = self.membership
        assert self.server is not None
        asked = self.requests.poll(m, self.server, now, finished=not self.growing)
        if asked:
            self.job.say(
                f"rank(s) {asked} failed a collective while no rank had left the world; "
                f"re-forming it with the same {len(m.members)} rank(s) {m.members} "
                f"(generation {m.generation})"
            )
            return True
        if not self.options.discovery_script:
            return False
        for lk in self.job.links:
            late = [i for i in lk.ranks if i in self.joiners and self.joiners[i] < now]
            if late:
                self.joiner_failed(
                    lk, late, f"rank(s) {late} on host {lk.host.name} were not ready in time"
                )
        waiting = [i for i in self.joiners if self.job.started(i)]
        if not waiting:
            return False
        have = self.server.present([elastic.ready_key(i) for i in waiting])
        ready: list[int] = []
        for lk in self.job.links:
            ids = [i for i in lk.ranks if i in self.joiners]
            if ids and all(elastic.ready_key(i) in have for i in ids):
                ready += ids
        if not ready or len(m.members) + len(ready) < m.min_np:
            return False
        hosts = sorted({self.rank_host[i] for i in ready})
        for i in ready:
            del self.joiners[i]
        m.add(*ready)
        self._announce()
        self.job.say(
            f"rank(s) {ready} on host(s) {', '.join(hosts)} ready: growing the world to "
            f"{len(m.members)} rank(s) {m.members} (generation {m.generation})"
        )
        return True

    def joiner_failed(self, link: AgentLink, ids: list[int], desc: str) -> None:
        """A rank started to join failed before it joined: its host is excluded, the job goes
        on. Its agent's other joiners are stopped with it."""
        for i in link.ranks:
            if i in self.joiners:
                del self.joiners[i]
                self.retired.add(i)
        self.stop_link(link)
        self.exclude(link.host.name, desc)

    def finishing(self) -> None:
        """A rank finished: the job is finishing, no new ranks; those not yet in stop."""
        if self.growing and self.membership is not None and self.joiners:
            ids = list(self.joiners)
            self.joiners.clear()
            self.retired.update(ids)
            for lk in self.job.links:
                if any(i in ids for i in lk.ranks):
                    self.stop_link(lk)
            self.job.log(f"a rank finished: stopping rank(s) {ids} that had not joined yet")
        self.growing = False

    def stop_link(self, link: AgentLink) -> None:
        """Stop an agent's ranks. One that started none ends by closing its input (it reports
        "done" only after ranks it ran), so the job does not wait for it."""
        if any(self.job.started(r) for r in link.ranks):
            link.send("stop")
        else:
            link.close_input()

    def exclude(self, host: str, why: str) -> None:
        """Horovod's blacklist: no new rank starts on ``host`` for a cool-down. Only a discovery
        script can offer a host again, so only then is it said."""
        if not self.options.discovery_script:
            return
        cooldown = self.exclusions.fail(host)
        n = self.exclusions.failures(host)
        if cooldown is None:
            span = "for the rest of the job (--blacklist-cooldown-range MIN MAX lets it back)"
        else:
            span = f"for {cooldown:.1f} s"
        self.job.say(f"excluding host {host} {span} after failure {n} of its ranks: {why}")

    def _spared(self, host: str) -> None:
        """A rank stopped on a preemption: no fault of its host's, which is not excluded (a
        re-created pod or a node back from maintenance is offered again under its name)."""
        if self.options.discovery_script:
            self.job.say(
                f"host {host} is not excluded: its rank stopped on a preemption; new ranks start "
                "there if the discovery script still offers it"
            )

    def _await_hosts(self, desc: str) -> bool:
        """Below --min-np with a discovery script: wait up to --elastic-timeout for hosts."""
        m = self.membership
        if not self.options.discovery_script or m is None or not m.members:
            return False
        self.job.say(
            f"{desc}; {len(m.members)} rank(s) remain, fewer than --min-np {m.min_np}: waiting "
            f"up to {self.options.elastic_timeout_s:g} s (--elastic-timeout) for the discovery "
            "script to offer hosts"
        )
        self._grow()
        return True

    def below_timeout(self, first: Failure) -> Failure:
        """The failure that ends a wait for hosts past --elastic-timeout."""
        m = self.membership
        assert m is not None
        where = ", ".join(f"{i} on {self.rank_host[i]}" for i in m.members)
        excluded = []
        for name in dict.fromkeys(self.rank_host.values()):
            left = self.exclusions.remaining_s(name)
            if left is not None:
                excluded.append(
                    f"{name} ({'for good' if left == float('inf') else f'{left:.0f} s more'})"
                )
        lines = [
            f"fewer than --min-np {m.min_np} ranks for {self.options.elastic_timeout_s:g} s "
            f"(--elastic-timeout): {len(m.members)} remain (rank(s) {where}), "
            f"{m.min_np - len(m.members)} more needed",
            *(f"  left: {d}" for d in self.left),
            f"  excluded hosts: {', '.join(excluded) or 'none'}",
            f"  the discovery script offers: {_listed(self.offered)}",
        ]
        return Failure(first.rank, first.host, first.code, "\n".join(lines), first.tail)


def _listed(hosts: list[Host]) -> str:
    return ", ".join(f"{h.name}:{h.slots}" for h in hosts) or "no host"
