"""LaunchOptions: the one typed object ``ringtrain run``'s flags map onto.

Job settings that the ranks read (fusion threshold, timeline, secure, ...) are not repeated here:
they are :class:`ringtrain.config.Config` fields, carried in ``settings`` and handed to every rank
as ``RINGTRAIN_*`` variables by :func:`ringtrain.config.to_env`, so a job started by torchrun or
Slurm is configured the same way. This object holds only what the launcher itself needs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from ringtrain.errors import ConfigError
from ringtrain.launch.hosts import Host
from ringtrain.launch.plan import PLACEMENTS

BIND_CHOICES = ("auto", "none", "core", "numa")
MALLOC_CHOICES = ("system", "jemalloc", "tcmalloc")


@dataclass(frozen=True)
class SshOptions:
    """How remote agents are reached. The user's OpenSSH client and its config are used as-is."""

    port: int | None = None
    identity_file: str | None = None
    config_file: str | None = None
    # Only an explicit flag relaxes host-key checking, and only to trust-on-first-use.
    accept_new_host_keys: bool = False
    connect_timeout_s: int = 10


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
    # After the first failure (or Ctrl-C), ranks get this long to exit before SIGKILL.
    grace_s: float = 3.0
    bind_to: str = "auto"
    malloc: str = "system"
    placement: str = "host-major"  # or "round-robin": see ringtrain.launch.plan
    verbose: bool = False
    prefix_output: bool = True
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

    def __post_init__(self) -> None:
        if self.np < 1:
            raise ConfigError(f"-np must be at least 1, got {self.np}")
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
        if self.start_timeout_s <= 0:
            raise ConfigError(f"--start-timeout must be > 0, got {self.start_timeout_s}")
        if self.elastic:
            lo = self.min_np if self.min_np is not None else self.np
            hi = self.max_np if self.max_np is not None else self.np
            if not 1 <= lo <= self.np <= hi:
                raise ConfigError(
                    f"elastic jobs need 1 <= --min-np <= -np <= --max-np; got --min-np {lo}, "
                    f"-np {self.np}, --max-np {hi}"
                )
            if self.elastic_timeout_s <= 0:
                raise ConfigError(f"--elastic-timeout must be > 0, got {self.elastic_timeout_s}")
            if self.reset_limit is not None and self.reset_limit < 0:
                raise ConfigError(f"--reset-limit must be >= 0, got {self.reset_limit}")
        if self.discovery_script is not None:
            if self.hosts:
                raise ConfigError(
                    "give --host-discovery-script or -H/--hostfile, not both: with a discovery "
                    "script the hosts are whatever it prints"
                )
            if self.min_np is None:
                raise ConfigError(
                    "--host-discovery-script needs --min-np (and usually --max-np).\n"
                    "HINT: ringtrain run -np 2 --min-np 2 --max-np 4 "
                    "--host-discovery-script ./hosts.sh -- python train.py"
                )
        if self.slots_per_host < 1:
            raise ConfigError(f"--slots-per-host must be at least 1, got {self.slots_per_host}")
        if self.cooldown_range is not None:
            cmin, cmax = self.cooldown_range
            if not 1.0 <= cmin <= cmax <= 3600.0:
                raise ConfigError(
                    f"--blacklist-cooldown-range {cmin:g} {cmax:g}: expected "
                    "1 <= MIN <= MAX <= 3600 seconds"
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
    def is_local(self) -> bool:
        return all(h.is_local for h in self.hosts)
