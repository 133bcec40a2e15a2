"""LaunchOptions: the one typed object ``ringtrain run``'s flags map onto.

Job settings that the ranks read (fusion threshold, timeline, secure, ...) are not repeated here:
they are :class:`ringtrain.config.Config` fields, carried in ``settings`` and handed to every rank
as ``RINGTRAIN_*`` variables by :func:`ringtrain.config.to_env`, so a job started by torchrun or
Slurm is configured the same way. This object holds only what the launcher itself needs.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ringtrain.config import Bounds
from ringtrain.errors import ConfigError
from ringtrain.launch.hosts import Host
from ringtrain.launch.plan import PLACEMENTS

BIND_CHOICES = ("auto", "none", "core", "numa")
PORT = Bounds(1, high=65535, whole=True, hint="a TCP port number, 1 to 65535.")
SECONDS = Bounds(0, above=True, unit="seconds")
MALLOC_CHOICES = ("system", "jemalloc", "tcmalloc")
KEEPALIVE_COUNT = 3  # ssh keepalives unanswered before ssh gives a host up (ServerAliveCountMax)


@dataclass(frozen=True)
class SshOptions:
    """How remote agents are reached. The user's OpenSSH client and its config are used as-is."""

    port: int | None = None
    identity_file: str | None = None
    config_file: str | None = None
    # Only an explicit flag relaxes host-key checking, and only to trust-on-first-use.
    accept_new_host_keys: bool = False
    connect_timeout_s: int = 10
    # Seconds between ssh's keepalives; a host silent for KEEPALIVE_COUNT of them is lost.
    keepalive_s: int = 5

    def __post_init__(self) -> None:
        if self.port is not None:
            object.__setattr__(self, "port", PORT.check("--ssh-port", self.port))
        # ssh's ConnectTimeout takes whole seconds; 0 or less would wait for the system's.
        timeout = Bounds(1, whole=True, unit="seconds").check(
            "--ssh-connect-timeout", self.connect_timeout_s, 10
        )
        object.__setattr__(self, "connect_timeout_s", timeout)
        every = Bounds(1, high=3600, whole=True, unit="seconds").check(
            "--ssh-keepalive", self.keepalive_s, 5
        )
        object.__setattr__(self, "keepalive_s", every)


@dataclass(frozen=True)
class LaunchOptions:
    np: int
    hosts: tuple[Host, ...]
    command: tuple[str, ...]
    settings: dict[str, Any] = field(default_factory=dict)
    ssh: SshOptions = SshOptions()
    # -x VAR or -x VAR=value: forwarded to every rank on top of the declared set.
    forward_env: tuple[str, ...] = ()
    start_timeout_s: float = 60.0
    # After the first failure, ranks get this long after SIGTERM before SIGKILL (after Ctrl-C or
    # a SIGTERM the launcher forwards: Config's grace_period_s, --grace-period).
    grace_s: float = 3.0
    bind_to: str = "auto"
    malloc: str = "system"
    placement: str = "host-major"  # or "round-robin": see ringtrain.launch.plan
    verbose: bool = False
    prefix_output: bool = True
    # --prefix-output-with-timestamp: each relayed line starts with the time the launcher got it
    # (one clock for every host, so lines of different hosts compare).
    timestamp_output: bool = False
    # --output-filename: each rank's output is also written to DIR/rank.<rank>/{stdout,stderr}.
    output_dir: str | None = None
    # --network-interfaces a,b (horovodrun): the automatic choice considers only these names.
    interface_candidates: tuple[str, ...] = ()
    # The interpreter that runs the agents (the same path on every host, as for the ranks).
    python: str = sys.executable
    # Elastic (any of these set): a rank that fails does not end the job while min_np remain.
    min_np: int | None = None
    max_np: int | None = None
    elastic_timeout_s: float = 600.0
    reset_limit: int | None = None
    # --host-discovery-script (horovodrun's): hosts come from it, re-run every second.
    discovery_script: str | None = None
    slots_per_host: int = 1
    # --blacklist-cooldown-range MIN MAX: a failing host comes back after a cool-down.
    cooldown_range: tuple[float, float] | None = None
    # What the launcher says before any rank starts: a --config-file's keys without effect. Kept
    # from its one reading (a file given as a pipe, <(...), reads empty the second time).
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Every number first: NaN, inf and negatives end here, before any host is reached.
        ranks = Bounds(1, whole=True, unit="ranks", hint="e.g. -np 4 --min-np 2 --max-np 8.")
        numbers = {
            "np": ("-np", ranks),
            "min_np": ("--min-np", ranks),
            "max_np": ("--max-np", ranks),
            "reset_limit": (
                "--reset-limit",
                Bounds(0, whole=True, unit="re-formations", hint="leave it unset for no limit."),
            ),
            "slots_per_host": ("--slots-per-host", Bounds(1, whole=True, unit="slots")),
            "start_timeout_s": ("--start-timeout", SECONDS),
            "grace_s": ("grace_s", Bounds(0, unit="seconds")),
            "elastic_timeout_s": ("--elastic-timeout", SECONDS),
        }
        defaults = {f.name: None if f.default is MISSING else f.default for f in fields(self)}
        for name, (flag, bounds) in numbers.items():
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, bounds.check(flag, value, defaults[name]))
        if not self.command:
            raise ConfigError(
                "no command to run.\nHINT: ringtrain run -np 2 -- python train.py [args]"
            )
        if self.bind_to not in BIND_CHOICES:
            raise ConfigError(f"--bind-to must be one of {', '.join(BIND_CHOICES)}")
        if self.malloc not in MALLOC_CHOICES:
            raise ConfigError(f"--malloc must be one of {', '.join(MALLOC_CHOICES)}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"--placement must be one of {', '.join(PLACEMENTS)}")
        if self.elastic:
            lo = self.min_np if self.min_np is not None else self.np
            hi = self.max_np if self.max_np is not None else self.np
            if not 1 <= lo <= self.np <= hi:
                raise ConfigError(
                    f"elastic jobs need 1 <= --min-np <= -np <= --max-np; got --min-np {lo}, "
                    f"-np {self.np}, --max-np {hi}\nHINT: e.g. -np 4 --min-np 2 --max-np 8: "
                    "start 4 ranks, go on while 2 remain, grow to 8 as hosts come."
                )
        if self.discovery_script is not None:
            if self.hosts:
                raise ConfigError(
                    "give --host-discovery-script or -H/--hostfile, not both: with a discovery "
                    "script the hosts are whatever it prints"
                )
            if self.min_np is None:
                raise ConfigError(
                    "--host-discovery-script needs --min-np (and usually -np and --max-np).\n"
                    "HINT: ringtrain run -np 2 --min-np 2 --max-np 4 "
                    "--host-discovery-script ./hosts.sh -- python train.py"
                )
        if self.cooldown_range is not None:
            cmin, cmax = self.cooldown_range
            if not 1.0 <= cmin <= cmax <= 3600.0:
                raise ConfigError(
                    f"--blacklist-cooldown-range {cmin:g} {cmax:g}: expected "
                    "1 <= MIN <= MAX <= 3600 seconds (finite numbers)\n"
                    "HINT: e.g. --blacklist-cooldown-range 10 300; leave it out to exclude a "
                    "failing host for the rest of the job."
                )
        for item in self.forward_env:
            name = item.split("=", 1)[0]
            if not name or not (name.replace("_", "a").isalnum() and not name[0].isdigit()):
                raise ConfigError(f"-x {item!r}: expected VAR or VAR=value")

    @property
    def elastic(self) -> bool:
        return (
            self.min_np is not None or self.max_np is not None or self.discovery_script is not None
        )

    @property
    def fewest(self) -> int:
        """The fewest ranks an elastic job goes on with: --min-np, else -np."""
        return self.min_np if self.min_np is not None else self.np

    @property
    def is_local(self) -> bool:
        return all(h.is_local for h in self.hosts)
