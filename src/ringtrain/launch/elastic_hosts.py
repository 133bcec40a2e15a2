"""Elastic jobs in the launcher: the world re-formed after a loss, hosts from a discovery script.

With ``--min-np``/``--max-np`` (:mod:`ringtrain.launch.elastic`) a rank that fails is dropped
and the survivors are told their new world, while at least ``--min-np`` remain. With
``--host-discovery-script`` (:mod:`ringtrain.launch.discovery`) the launcher also starts ranks on
hosts the script offers (up to ``--max-np``; a host's new ranks join together once all are
ready), retires those of hosts it no longer offers, excludes hosts whose ranks failed for a
cool-down (Horovod's blacklist), and below ``--min-np`` waits up to ``--elastic-timeout`` for
new hosts. :class:`ElasticHosts` is a part of :class:`~ringtrain.launch.supervisor.Supervisor`,
which holds the job's state and calls these methods from its event loop.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from ringtrain.errors import LaunchError
from ringtrain.launch import discovery, elastic, job_network
from ringtrain.launch.agent_link import AgentLink
from ringtrain.launch.failures import Failure
from ringtrain.launch.hosts import Host
from ringtrain.launch.options import LaunchOptions
from ringtrain.launch.plan import ProcessSpec, plan
from ringtrain.launch.rendezvous import RendezvousServer


class ElasticHosts:
    """The supervisor's elastic part. The state and methods declared below are the
    supervisor's, set in its ``__init__`` and defined in its class."""

    options: LaunchOptions
    specs: list[ProcessSpec]
    _hosts: list[Host]
    _links: list[AgentLink]
    _pids: dict[int, int]
    _exits: dict[int, dict[str, Any]]
    _failure: Failure | None
    _interrupts: int
    _server: RendezvousServer | None
    _membership: elastic.Membership | None
    _exclusions: discovery.Exclusions
    _offered: list[Host]
    _rank_host: dict[int, str]  # every rank ever started: identity -> host
    _joiners: dict[int, float]  # started, not yet in a world: id -> ready by
    _retired: set[int]  # stopped on purpose (host no longer offered)
    _left: list[str]  # how each rank that left the world went
    _below: tuple[float, Failure] | None  # below --min-np since, and why
    _growing: bool  # until a rank finishes
    _next_check: float
    # The supervisor's methods this part calls.
    _say: Callable[[str], None]
    _log: Callable[[str], None]
    _fail: Callable[[Failure], None]
    _is_local: Callable[[], bool]
    _start_agent: Callable[[Host], AgentLink]
    _launch: Callable[..., None]  # (link, specs, identities, host_net, join, bind_to)

    # ---- the world after a loss -----------------------------------------------------------------

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
                iface = str(self.options.settings.get("network_interface") or "")
                _, host_env = job_network.plan(self._links, iface, self.options)
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


def _listed(hosts: list[Host]) -> str:
    return ", ".join(f"{h.name}:{h.slots}" for h in hosts) or "no host"
