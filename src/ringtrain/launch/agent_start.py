"""How an agent is started on a host: a local child process, or the user's ssh client.

The agent's command is an argv list; it is quoted exactly once, here, where ssh turns it into
the remote shell's command line. Host aliases, ports, jump hosts and keys in ``~/.ssh/config``
apply because the real OpenSSH client is used. Host-key checking is left to that config: only
``--ssh-accept-new-host-keys`` relaxes it, and only to trust-on-first-use.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from ringtrain.launch.hosts import Host
from ringtrain.launch.options import KEEPALIVE_COUNT, SshOptions

AGENT_MODULE = "ringtrain.launch.agent"


def agent_argv(python: str, list_interfaces: bool = True, names: Sequence[str] = ()) -> list[str]:
    """The agent's command. Without ``list_interfaces`` it enumerates no network interfaces
    (an enclave-ready job with an explicit interface: enclave runtimes have no netlink) and
    reports only the ``names`` it has, by ioctl."""
    if list_interfaces:
        return [python, "-u", "-m", AGENT_MODULE]
    named = ["--interface-names", ",".join(names)] if names else []
    return [python, "-u", "-m", AGENT_MODULE, "--no-interfaces", *named]


def ssh_argv(host: Host, ssh: SshOptions, remote: Sequence[str], cwd: str) -> list[str]:
    """The local argv that runs ``remote`` in ``cwd`` on ``host`` over ssh."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={ssh.connect_timeout_s}"]
    # The launcher notices a dead link through the agent's stdin; keepalives make ssh notice too.
    argv += ["-o", f"ServerAliveInterval={ssh.keepalive_s}"]
    argv += ["-o", f"ServerAliveCountMax={KEEPALIVE_COUNT}"]
    if ssh.config_file:
        argv += ["-F", ssh.config_file]
    if ssh.port is not None:
        argv += ["-p", str(ssh.port)]
    if ssh.identity_file:
        argv += ["-i", ssh.identity_file]
    if ssh.accept_new_host_keys:
        argv += ["-o", "StrictHostKeyChecking=accept-new"]
    # Falls back to $HOME when the launcher's directory does not exist on the remote host.
    script = f"cd {shlex.quote(cwd)} 2>/dev/null || cd; exec {shlex.join(remote)}"
    return [*argv, host.name, script]


def command_for(
    host: Host,
    ssh: SshOptions,
    python: str,
    cwd: str,
    list_interfaces: bool = True,
    names: Sequence[str] = (),
) -> list[str]:
    argv = agent_argv(python, list_interfaces, names)
    return argv if host.is_local else ssh_argv(host, ssh, argv, cwd)
