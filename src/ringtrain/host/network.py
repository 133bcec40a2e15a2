"""Which network interface the job uses on each host, and where the ranks find the rendezvous.

Every host's agent reports its interfaces (:func:`local_interfaces`, sent in its hello); the
launcher then picks, per host, the interface to use:

- ``--network-interface`` given (:func:`resolve_spec`): one name for every host (``eth0``),
  one per host (``h0=eth0,h1=eth7``, a bare name is the default for hosts not listed), or a
  CIDR (``10.0.0.0/24``: on each host, the interface whose address is inside it). A value may
  also be one host's address (``h1=10.0.0.7``).
- nothing given (:func:`choose`): the interface, per host, on a subnet that every host has an
  address in. Names may differ between hosts. Loopback is never used. A subnet where two hosts
  have the same address is not routed between them (every host's ``docker0`` is 172.17.0.1/16),
  so it is never chosen; among the rest, bridges and container-runtime interfaces come last.

The ranks get the choice as ``RINGTRAIN_NETWORK_INTERFACE``, ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` (:func:`interface_env`), and the rendezvous address is the launcher's own
address on the chosen subnet (:func:`rendezvous_address`).

Secure mode with an explicit interface or address enumerates no interfaces on the launcher
(enclave runtimes such as Gramine have no netlink): the address comes from a routing lookup
(a UDP ``connect``, which sends nothing) or one ``SIOCGIFADDR`` ioctl on the named interface.

This module is pure apart from :func:`local_interfaces` and those two lookups, and imports
neither torch nor numpy.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import socket
import struct
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import psutil

from ringtrain.environ import Torch, setting_var
from ringtrain.errors import ConfigError, LaunchError

# Interfaces of container and VM runtimes: host-local bridges, never the job's network.
_RUNTIME_NAMES = re.compile(
    r"^(docker\d*|br-[0-9a-f]{12}|virbr\d+|cni\d*|podman\d*|lxcbr\d*|lxdbr\d*|cali.*|flannel.*|"
    r"vxlan\.calico|kube-bridge|weave|tunl\d+)$"
)
# What a --network-interface value may name: 1-15 chars, none of "/", ",", "=" or spaces.
_IFNAME = re.compile(r"^[^\s/,=]{1,15}$")
_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B

# What probing found: reachable(src_host, address), or src_host -> the addresses it reached.
Reachable = Union[Callable[[str, str], bool], Mapping[str, Collection[str]]]  # noqa: UP007


@dataclass(frozen=True)
class Interface:
    """One IPv4 address of one interface (an interface with none has ``address == ""``)."""

    name: str
    address: str = ""
    prefixlen: int = 0
    is_up: bool = True
    is_loopback: bool = False
    # "bridge": a Linux bridge; "docker": named like a container/VM runtime's bridge (docker0,
    # br-..., virbr0, cni0); "virtual": no physical device behind it (veth, tun, bridge, ...).
    flags: tuple[str, ...] = ()

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.address}/{self.prefixlen}", strict=False)

    @property
    def is_host_local(self) -> bool:
        """A bridge or runtime interface: usually reaches only this host's containers."""
        return "bridge" in self.flags or "docker" in self.flags

    def label(self) -> str:
        return f"{self.name} {self.address}/{self.prefixlen}" if self.address else self.name

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "address": self.address,
            "prefixlen": self.prefixlen,
            "is_up": self.is_up,
            "is_loopback": self.is_loopback,
            "flags": list(self.flags),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Interface:
        return cls(
            name=str(d["name"]),
            address=str(d.get("address") or ""),
            prefixlen=int(d.get("prefixlen") or 0),
            is_up=bool(d.get("is_up", True)),
            is_loopback=bool(d.get("is_loopback", False)),
            flags=tuple(sorted(str(f) for f in d.get("flags", ()))),
        )


# ---- discovery (the only part that looks at the machine) ----------------------------------------


def local_interfaces() -> list[Interface]:
    """This host's interfaces with their IPv4 addresses, sorted by name then address."""
    addrs = psutil.net_if_addrs()
    stats = psutil.net_if_stats()
    out = []
    for name in sorted(addrs):
        st = stats.get(name)
        is_up = bool(st and st.isup)
        is_loopback = name == "lo" or bool(st and "loopback" in getattr(st, "flags", "").split(","))
        flags = _flags(name)
        ipv4 = [a for a in addrs[name] if a.family == socket.AF_INET]
        if not ipv4:
            out.append(Interface(name, "", 0, is_up, is_loopback, flags))
        for a in sorted(ipv4, key=lambda a: ipaddress.IPv4Address(a.address)):
            prefix = ipaddress.IPv4Network(f"0.0.0.0/{a.netmask or '255.255.255.255'}").prefixlen
            loop = is_loopback or ipaddress.IPv4Address(a.address).is_loopback
            out.append(Interface(name, a.address, prefix, is_up, loop, flags))
    return out


def named_interfaces(names: Sequence[str]) -> list[Interface]:
    """The named interfaces that exist here, with address and netmask by ``ioctl``: no netlink,
    no enumeration (what an agent reports when the job must run where netlink is missing)."""
    out = []
    for name in names:
        address = interface_address(name)
        if address is None:
            continue
        prefix = 32
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(
                s.fileno(), _SIOCGIFNETMASK, struct.pack("256s", name.encode()[:15])
            )
            prefix = ipaddress.IPv4Network(f"0.0.0.0/{socket.inet_ntoa(packed[20:24])}").prefixlen
        loop = ipaddress.IPv4Address(address).is_loopback
        out.append(Interface(name, address, prefix, True, loop))
    return out


def spec_names(spec: str) -> list[str]:
    """The interface names a ``--network-interface`` value mentions (not addresses or CIDRs)."""
    names = []
    for token in spec.split(","):
        value = token.rpartition("=")[2].strip()
        if value and _IFNAME.match(value) and not re.fullmatch(r"[\d.]+", value):
            names.append(value)
    return sorted(set(names))


def _flags(name: str) -> tuple[str, ...]:
    flags = []
    # sysfs shows the namespace's own interfaces when it was mounted there (ip netns exec does).
    if os.path.isdir(f"/sys/class/net/{name}/bridge"):
        flags.append("bridge")
    if _RUNTIME_NAMES.match(name):
        flags.append("docker")
    if os.path.isdir(f"/sys/class/net/{name}") and not os.path.exists(
        f"/sys/class/net/{name}/device"
    ):
        flags.append("virtual")
    return tuple(flags)


# ---- choosing -----------------------------------------------------------------------------------


def _usable(ifaces: Sequence[Interface]) -> list[Interface]:
    out = []
    for i in ifaces:
        if not i.address or not i.is_up or i.is_loopback:
            continue
        ip = ipaddress.IPv4Address(i.address)
        if ip.is_loopback or ip.is_link_local or ip.is_unspecified:
            continue
        out.append(i)
    return out


def _preference(i: Interface) -> tuple[bool, str, ipaddress.IPv4Address]:
    return (i.is_host_local, i.name, ipaddress.IPv4Address(i.address))


def _reaches(reachable: Reachable | None, src: str, address: str) -> bool:
    if reachable is None:
        return True
    if callable(reachable):
        return bool(reachable(src, address))
    return address in reachable.get(src, ())


def choose(
    per_host: Mapping[str, Sequence[Interface]], reachable: Reachable | None = None
) -> dict[str, Interface]:
    """Per host, the interface on a subnet shared by every host. Deterministic.

    ``reachable``, when given, is what probing found: ``reachable(src_host, address)`` or a
    mapping ``src_host -> addresses it reached``; a subnet counts only if every host reaches
    every other host's address on it. Raises :class:`LaunchError` saying what each host has.
    """
    if not per_host:
        raise LaunchError("no hosts to choose a network interface for")
    usable = {h: _usable(ifaces) for h, ifaces in per_host.items()}
    silent = [h for h, ifaces in per_host.items() if not ifaces]
    if silent:
        raise LaunchError(
            f"host(s) {', '.join(silent)} reported no network interfaces, so ringtrain cannot "
            "tell which one the job should use.\n"
            "HINT: pass --network-interface NAME (or HOST=NAME,... or a CIDR such as 10.0.0.0/24)."
        )
    networks = sorted(
        {i.network for ifaces in usable.values() for i in ifaces},
        key=lambda n: (n.network_address, -n.prefixlen),
    )
    options: list[tuple[tuple[int, int, ipaddress.IPv4Address], dict[str, Interface]]] = []
    problems: list[str] = []
    for net in networks:
        pick: dict[str, Interface] = {}
        for host, ifaces in usable.items():
            inside = [i for i in ifaces if ipaddress.IPv4Address(i.address) in net]
            if not inside:
                break
            pick[host] = min(inside, key=_preference)
        else:
            by_addr: dict[str, list[str]] = {}
            for host, i in pick.items():
                by_addr.setdefault(i.address, []).append(host)
            shared = {a: hs for a, hs in by_addr.items() if len(hs) > 1}
            if shared:
                problems.extend(
                    f"{net} is not routed between hosts: {', '.join(hs)} all have {a}"
                    for a, hs in sorted(shared.items())
                )
                continue
            missed = [
                f"{src} cannot reach {dst}'s {pick[dst].address} ({pick[dst].name})"
                for src in pick
                for dst in pick
                if src != dst and not _reaches(reachable, src, pick[dst].address)
            ]
            if missed:
                problems.extend(missed)
                continue
            host_local = sum(i.is_host_local for i in pick.values())
            options.append(((host_local, -net.prefixlen, net.network_address), pick))
    if options:
        return dict(min(options, key=lambda o: o[0])[1])
    raise LaunchError(_no_common_subnet(per_host, problems))


def _no_common_subnet(per_host: Mapping[str, Sequence[Interface]], problems: list[str]) -> str:
    lines = ["no subnet is shared, and routed, between all hosts, so their ranks cannot connect."]
    for host, ifaces in per_host.items():
        shown = [
            i.label() + (" (down)" if not i.is_up else "")
            for i in ifaces
            if i.address and not i.is_loopback
        ]
        lines.append(f"  {host}: {', '.join(shown) or 'no IPv4 addresses'}")
    lines.extend(f"  {p}" for p in problems)
    lines.append(
        "HINT: pass --network-interface NAME (the same name on every host), "
        "HOST=NAME,HOST=NAME (one per host), or a CIDR such as 10.0.0.0/24 that holds one "
        "address of every host."
    )
    return "\n".join(lines)


# ---- explicit choice ----------------------------------------------------------------------------


def _parse_value(value: str, token: str, spec: str) -> Any:
    """A CIDR (IPv4Network), one address (IPv4Address) or an interface name (str)."""
    try:
        if "/" in value:
            return ipaddress.IPv4Network(value, strict=False)
        return ipaddress.IPv4Address(value)
    except ValueError:
        if "/" in value or re.fullmatch(r"[\d.]+", value):
            raise ConfigError(
                f"--network-interface {spec!r}: {token!r} is not a valid IPv4 "
                f"{'CIDR' if '/' in value else 'address'}.\nHINT: e.g. 10.0.0.0/24"
            ) from None
    if not _IFNAME.match(value):
        raise ConfigError(
            f"--network-interface {spec!r}: {token!r} is not an interface name "
            "(1-15 characters, no spaces, '/', ',' or '=').\n"
            "HINT: NAME, HOST=NAME,HOST=NAME, or a CIDR such as 10.0.0.0/24"
        )
    return value


def resolve_spec(spec: str, hosts: Mapping[str, Sequence[Interface]]) -> dict[str, Interface]:
    """Per host, the interface that ``--network-interface spec`` designates.

    ``hosts`` maps each host to its reported interfaces; an empty list means they were not
    enumerated, and a name is then taken on trust. Syntax errors are :class:`ConfigError`,
    a value that matches nothing on a host is :class:`LaunchError`; both quote the token.
    """
    default: tuple[str, Any] | None = None
    per: dict[str, tuple[str, Any]] = {}
    for raw in spec.split(","):
        token = raw.strip()
        if not token:
            raise ConfigError(
                f"--network-interface {spec!r} has an empty entry.\n"
                "HINT: NAME, HOST=NAME,HOST=NAME, or a CIDR such as 10.0.0.0/24"
            )
        host, sep, value = token.rpartition("=")
        if sep:
            host, value = host.strip(), value.strip()
            if host not in hosts:
                raise ConfigError(
                    f"--network-interface {spec!r}: {token!r} names host {host!r}, which is not "
                    f"in the job.\nHINT: the job's hosts are {', '.join(hosts)}"
                )
            if host in per:
                raise ConfigError(f"--network-interface {spec!r}: host {host!r} is given twice")
            per[host] = (token, _parse_value(value, token, spec))
        elif default is not None:
            raise ConfigError(
                f"--network-interface {spec!r}: {token!r} and {default[0]!r} both apply to every "
                "host.\nHINT: give one default, and HOST=NAME for the hosts that differ"
            )
        else:
            default = (token, _parse_value(token, token, spec))
    out = {}
    for host, ifaces in hosts.items():
        given = per.get(host, default)
        if given is None:
            raise ConfigError(
                f"--network-interface {spec!r} says nothing about host {host!r}.\n"
                f"HINT: add {host}=NAME, or a bare NAME as the default for every host"
            )
        out[host] = _match(host, ifaces, *given)
    return out


def _match(host: str, ifaces: Sequence[Interface], token: str, value: Any) -> Interface:
    if isinstance(value, str):
        named = [i for i in ifaces if i.name == value]
        if named:
            with_ip = _usable(named) or [i for i in named if i.address] or named
            return min(with_ip, key=lambda i: (not i.address, i.address))
        if not ifaces:
            return Interface(value)  # not enumerated: trust the user
        what = f"has no interface named {value!r}"
    else:
        if not ifaces:
            raise LaunchError(
                f"--network-interface {token!r}: host {host} reported no interfaces, so an "
                "address or CIDR cannot be mapped to one.\nHINT: name the interface instead"
            )
        if isinstance(value, ipaddress.IPv4Network):
            inside = [i for i in _usable(ifaces) if ipaddress.IPv4Address(i.address) in value]
            what = f"has no address in {value}"
        else:
            inside = [i for i in ifaces if i.address == str(value)]
            what = f"has no interface with address {value}"
        if inside:
            return min(inside, key=_preference)
    have = ", ".join(i.label() for i in ifaces) or "none"
    raise LaunchError(
        f"--network-interface {token!r}: host {host} {what}; it has: {have}.\n"
        "HINT: pass HOST=NAME for hosts whose interface is named differently, or a CIDR "
        "such as 10.0.0.0/24 to use each host's interface with an address in that subnet."
    )


# ---- the rendezvous address --------------------------------------------------------------------


def route_source(address: str) -> str | None:
    """The local address the kernel would send from to reach ``address``; None if no route.

    A UDP ``connect`` only consults the routing table: no packet is sent.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def interface_address(name: str) -> str | None:
    """The IPv4 address of one named interface, by ioctl (no netlink, no enumeration)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def local_address(interface: str, rendezvous_addr: str = "") -> str:
    """This host's IPv4 address for the mesh, found without netlink (see the module doc)."""
    names = [n.strip() for n in interface.split(",") if n.strip()]
    if names:
        return address_of(names[0])
    if rendezvous_addr:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((rendezvous_addr, 9))  # consults the routing table; sends nothing
            return str(s.getsockname()[0])
    return "127.0.0.1"


def address_of(name: str) -> str:
    """An interface's IPv4 address by ``SIOCGIFADDR`` (an address is returned as it is)."""
    try:
        socket.inet_aton(name)
        return name
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError as e:
        raise ConfigError(
            f"network interface {name!r} has no IPv4 address here ({e.strerror}).\n"
            "HINT: check RINGTRAIN_NETWORK_INTERFACE / GLOO_SOCKET_IFNAME on this host."
        ) from e


def rendezvous_address(
    chosen: Mapping[str, Interface], local: Sequence[Interface] | None = None
) -> str:
    """The launcher's address that every host can reach: its own on the chosen subnet.

    ``local`` is the launcher's interfaces; None means do not enumerate (secure mode), and the
    address comes from the routing table or from the interface of the chosen name.
    """
    targets = [ipaddress.IPv4Address(i.address) for i in chosen.values() if i.address]
    if local is not None:
        scored = []
        for li in _usable(local):
            hits = sum(t in li.network for t in targets)
            if hits:
                scored.append(((-hits, -li.prefixlen, li.name, li.address), li.address))
        if scored:
            return min(scored)[1]
    for t in targets:
        src = route_source(str(t))
        if src and (not ipaddress.IPv4Address(src).is_loopback or t.is_loopback):
            return src
    names = {i.name for i in chosen.values()}
    if len(names) == 1:
        addr = interface_address(names.pop())
        if addr:
            return addr
    where = ", ".join(f"{h}: {i.label()}" for h, i in chosen.items())
    raise LaunchError(
        f"cannot tell at which address the hosts can reach this launcher's rendezvous (they "
        f"use {where}); this machine has no address on their subnet and no route to them.\n"
        "HINT: run ringtrain from a machine on the hosts' network, or from one of the hosts"
    )


def _only_named(
    hosts: Mapping[str, Sequence[Interface]], names: Sequence[str]
) -> dict[str, list[Interface]]:
    out = {h: [i for i in ifaces if i.name in names] for h, ifaces in hosts.items()}
    for h, kept in out.items():
        if not kept and hosts[h]:
            has = ", ".join(sorted({i.name for i in hosts[h]}))
            raise LaunchError(
                f"--network-interfaces {','.join(names)}: host {h} has none of them (it has "
                f"{has}).\nHINT: list the names every host may use, or pick per host with "
                "--network-interface HOST=NAME,..."
            )
    return out


# ---- everything the launcher needs ---------------------------------------------------------------


def interface_env(name: str) -> dict[str, str]:
    """What a rank on a host needs to use interface ``name`` (ringtrain, Gloo and NCCL)."""
    return {
        setting_var("network_interface"): name,
        Torch.GLOO_SOCKET_IFNAME: name,
        Torch.NCCL_SOCKET_IFNAME: name,
    }


def plan_network(
    per_host: Mapping[str, Sequence[Interface | Mapping[str, Any]]],
    spec: str = "",
    *,
    secure: bool = False,
    local: Sequence[Interface] | None = None,
    reachable: Reachable | None = None,
    candidates: Sequence[str] = (),
) -> tuple[str, dict[str, dict[str, str]]]:
    """The rendezvous address and each host's interface variables, from the agents' reports.

    ``per_host`` holds each host's interfaces as reported (dicts from the agents' hellos, or
    :class:`Interface`). ``local`` defaults to this machine's interfaces, except in secure mode
    with an explicit ``spec``, where nothing is enumerated. ``candidates`` (horovodrun's
    ``--network-interfaces a,b``) limits the automatic choice to interfaces of those names.
    """
    hosts = {
        h: [i if isinstance(i, Interface) else Interface.from_dict(i) for i in ifaces]
        for h, ifaces in per_host.items()
    }
    if candidates and not spec.strip():
        hosts = _only_named(hosts, candidates)
    chosen = resolve_spec(spec, hosts) if spec.strip() else choose(hosts, reachable)
    if local is None and not (secure and spec.strip()):
        with contextlib.suppress(OSError):
            local = local_interfaces()
    return rendezvous_address(chosen, local), {h: interface_env(i.name) for h, i in chosen.items()}
