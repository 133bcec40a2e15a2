"""The ssh flags of every subcommand that reaches other hosts (``ringtrain run``, ``ringtrain
doctor``): the parser's group, the :class:`SshOptions` it describes, and the check of the files
ssh will read."""

from __future__ import annotations

import argparse
import os

from ringtrain.errors import ConfigError
from ringtrain.launch.options import KEEPALIVE_COUNT, SshOptions


def add_ssh_arguments(p: argparse.ArgumentParser) -> None:
    """The ssh flags, shared by every subcommand that reaches hosts (run, doctor)."""
    ssh = p.add_argument_group("ssh")
    ssh.add_argument("-p", "--ssh-port", type=int, help="ssh port on every host")
    ssh.add_argument("-i", "--ssh-identity-file", help="ssh private key")
    ssh.add_argument("--ssh-config-file", help="ssh client config (ssh -F)")
    ssh.add_argument(
        "--ssh-accept-new-host-keys",
        action="store_true",
        help="trust hosts whose keys are not yet known (trust on first use)",
    )
    ssh.add_argument(
        "--ssh-connect-timeout",
        type=int,
        default=SshOptions.connect_timeout_s,
        metavar="S",
        help=f"seconds for ssh to connect (default {SshOptions.connect_timeout_s})",
    )
    ssh.add_argument(
        "--ssh-keepalive",
        type=int,
        default=SshOptions.keepalive_s,
        metavar="S",
        help=f"seconds between ssh keepalives; a host silent for {KEEPALIVE_COUNT} of them is "
        f"lost (default {SshOptions.keepalive_s})",
    )


def check_ssh_files(ssh: SshOptions, remote: bool) -> None:
    """The files ssh reads on this host (``-i``, ``--ssh-config-file``), when it reaches other
    hosts (``remote``): a missing config file fails every connection, a missing key is skipped
    with a warning and another tried; both only after the job began."""
    if not remote:
        return
    for flag, path in (
        ("--ssh-identity-file", ssh.identity_file),
        ("--ssh-config-file", ssh.config_file),
    ):
        if not path:
            continue
        full = os.path.abspath(os.path.expanduser(path))  # ssh expands ~ in both
        if not os.path.isfile(full) or not os.access(full, os.R_OK):
            what = "is a directory" if os.path.isdir(full) else "is not a readable file"
            if not os.path.exists(full):
                what = "does not exist"
            raise ConfigError(
                f"{flag} {path!r}: {full} {what}.\n"
                "HINT: give the path of a file this user can read on this host, or leave the "
                "flag out to use ssh's own defaults (~/.ssh/config)."
            )


def ssh_options(args: argparse.Namespace) -> SshOptions:
    """The :class:`SshOptions` the flags of :func:`add_ssh_arguments` describe."""
    return SshOptions(
        port=args.ssh_port,
        identity_file=args.ssh_identity_file,
        config_file=args.ssh_config_file,
        accept_new_host_keys=args.ssh_accept_new_host_keys,
        connect_timeout_s=args.ssh_connect_timeout,
        keepalive_s=args.ssh_keepalive,
    )
