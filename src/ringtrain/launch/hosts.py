"""Host specifications: ``-H a:2,b:2`` and ``--hostfile`` (``host slots=N`` lines)."""

from __future__ import annotations

import functools
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from ringtrain.errors import HostSpecError

# Every host error is one line and a HINT (the CLI's rule for bad input).
_SLOTS_HINT = "HINT: slots are a whole number >= 1: host:4 or 'host slots=4'."

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "local"})


@functools.cache
def _own_names() -> frozenset[str]:
    """This machine's own hostname, as ``hostname`` prints it and its first label: a hostfile
    that lists the launch node by name means this machine, which needs no ssh to itself (as in
    Horovod). No name lookup: resolving every host could wait on DNS."""
    name = socket.gethostname()
    return frozenset({name, name.split(".")[0]} - {""})


# A host name, an ssh alias, an IPv4 address or a bracketed IPv6 address; optionally user@.
_HOST = re.compile(r"^(?:[A-Za-z0-9_.-]+@)?(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:]+\])$")


@dataclass(frozen=True)
class Host:
    """One machine of the job: the name ssh is given, and how many ranks it may run."""

    name: str
    slots: int

    @property
    def is_local(self) -> bool:
        return self.name in LOCAL_NAMES or self.name in _own_names()


def parse_hosts(spec: str, flag: str = "") -> list[Host]:
    """Parse ``a:2,b:2`` (slots default to 1). Repeated hosts are an error. ``flag``: the flag
    that gave ``spec`` (``-H``), named when it lists no host at all (``-H ""``)."""
    if flag and not spec.replace(",", "").strip():
        raise HostSpecError(
            f"{flag} {spec!r} lists no hosts.\n"
            f"HINT: give hosts and their slots, e.g. {flag} a:2,b:2, or leave {flag} out to run "
            "every rank on this host."
        )
    hosts = []
    for token in spec.split(","):
        token = token.strip()
        if not token:
            raise HostSpecError(
                f"empty entry in host list {spec!r}.\nHINT: separate hosts by one comma: a:2,b:2"
            )
        name, sep, slots = token.rpartition(":") if not token.endswith("]") else (token, "", "")
        if not sep:
            name, slots = token, "1"
        hosts.append(_host(name, slots, token))
    return _unique(hosts, spec)


def parse_hostfile(path: str | Path) -> list[Host]:
    """Parse a hostfile: one ``host [slots=N]`` per line (``host:N`` too); ``#`` comments."""
    if not str(path).strip():  # Path("") is the current directory
        raise HostSpecError(
            f"--hostfile {str(path)!r} names no file.\n"
            "HINT: give a file with one 'host slots=N' a line, or leave --hostfile out to run "
            "every rank on this host."
        )
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise HostSpecError(
            f"cannot read hostfile {str(path)!r}: {e.strerror}.\n"
            "HINT: give a readable file with one 'host slots=N' a line, or -H a:2,b:2."
        ) from None
    except UnicodeDecodeError as e:  # e.g. saved as UTF-16 by a Windows editor
        raise HostSpecError(
            f"hostfile {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}).\n"
            "HINT: save it as plain UTF-8 (or ASCII) text, one 'host slots=N' a line."
        ) from None
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{lineno}"
        parts = line.split()
        if len(parts) == 1:
            hosts.extend(parse_hosts(parts[0]))
            continue
        if len(parts) != 2 or not parts[1].startswith(("slots=", "max_slots=")):
            raise HostSpecError(
                f"{where}: cannot parse {line!r}.\nHINT: write one 'HOST slots=N' (or 'HOST:N') "
                "a line."
            )
        hosts.append(_host(parts[0], parts[1].split("=", 1)[1], line))
    if not hosts:
        raise HostSpecError(
            f"hostfile {str(path)!r} lists no hosts (only blank lines or comments).\n"
            "HINT: add one 'host slots=N' a line, e.g. 'localhost slots=2'."
        )
    return _unique(hosts, str(path))


def _host(name: str, slots: str, token: str) -> Host:
    if not _HOST.match(name):
        raise HostSpecError(
            f"bad host name in {token!r}.\n"
            "HINT: write NAME[:SLOTS], NAME a host, ssh alias or address, e.g. node1:4."
        )
    try:
        n = int(slots)
    except ValueError:
        raise HostSpecError(
            f"bad slot count in {token!r}: {slots!r} is not a number.\n{_SLOTS_HINT}"
        ) from None
    if n < 1:
        raise HostSpecError(
            f"bad slot count in {token!r}: a host needs at least 1 slot.\n{_SLOTS_HINT}"
        )
    return Host(name, n)


def _unique(hosts: list[Host], where: str) -> list[Host]:
    seen: set[str] = set()
    here: Host | None = None  # this machine, under the first of its names listed
    for h in hosts:
        if h.name in seen:
            raise HostSpecError(
                f"host {h.name!r} is listed twice in {where!r}.\n"
                "HINT: give it once with all its slots, e.g. localhost:4."
            )
        seen.add(h.name)
        if h.is_local and here is not None:
            # Two agents here, each sure it has a host of its own: every rank local_rank 0
            # (one GPU for all under set_device(local_rank())), each bound to the same cores.
            raise HostSpecError(
                f"{here.name!r} and {h.name!r} both name this machine in {where!r}: its ranks "
                "would run as on two hosts, each with local_rank 0 (the same GPU) and the same "
                f"cores.\nHINT: give this machine once with all its slots, e.g. "
                f"{here.name}:{here.slots + h.slots}."
            )
        if h.is_local:
            here = h
    return hosts
