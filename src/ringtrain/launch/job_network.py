"""The launcher's network choice for one job, from what each host's agent reported in its hello.

:mod:`ringtrain.host.network` holds the rules (interface specs, the common subnet, the
rendezvous address); this module applies them to a job's agents: which interface the user named
(flag, ``RINGTRAIN_NETWORK_INTERFACE`` or ``HOROVOD_GLOO_IFACE``), the check that it exists on
every host before any rank starts (one error from the launcher instead of a Gloo traceback on
every rank), and the per-host interface variables for the ranks. Enclave jobs (secure mode or
the TCP transport, with a named interface) enumerate no interfaces: enclaves lack netlink.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ringtrain.config import env_var
from ringtrain.environ import horovod_settings
from ringtrain.errors import LaunchError
from ringtrain.host import network
from ringtrain.launch.agent_link import AgentLink
from ringtrain.launch.options import LaunchOptions


def enclave_ready(settings: Mapping[str, Any]) -> bool:
    """Secure mode or the TCP transport with an explicit interface: agents look the named
    interfaces up one by one instead of listing them all."""
    enclave = settings.get("secure") or settings.get("transport") == "tcp"
    return bool(enclave and settings.get("network_interface"))


def named_interface(options: LaunchOptions, env: Mapping[str, str]) -> str:
    """The interface spec the user gave: the flag, else the ringtrain variable, else Horovod's."""
    return str(
        options.settings.get("network_interface")
        or env.get(env_var("network_interface"), "")
        or horovod_settings(env).get("network_interface", "")  # HOROVOD_GLOO_IFACE
    )


def reported_interfaces(links: Sequence[AgentLink]) -> dict[str, list[network.Interface]]:
    """Each host's interfaces, as its agent reported them."""
    return {
        lk.host.name: [network.Interface.from_dict(i) for i in lk.hello.get("interfaces", [])]
        for lk in links
        if lk.hello
    }


def check_interface(iface: str, links: Sequence[AgentLink], settings: Mapping[str, Any]) -> None:
    """A ``--network-interface`` some host lacks fails here, once, from what the agents
    reported, rather than in every rank's Gloo (:func:`check_interface_on`)."""
    check_interface_on(iface, reported_interfaces(links), settings)


def check_interface_on(
    iface: str,
    per_host: Mapping[str, Sequence[network.Interface]],
    settings: Mapping[str, Any],
) -> dict[str, network.Interface]:
    """The launcher's check of a named interface against each host's reported interfaces
    (an empty list: not enumerated, the name taken on trust), also the doctor's, so the two
    never disagree. Agents of enclave jobs look the named interfaces up one by one (no
    enumeration): one they did not report has no IPv4 address on that host. Returns the
    interface each host would use; :class:`LaunchError` names the host that lacks it."""
    chosen = network.resolve_spec(iface, per_host)
    missing = sorted(h for h, i in chosen.items() if not i.address)
    if enclave_ready(settings) and missing:
        raise LaunchError(
            f"--network-interface {iface!r}: no interface of that name has an IPv4 address "
            f"on {', '.join(missing)}.\nHINT: check the name with `ip -4 addr` on each "
            "host, or pass HOST=NAME for hosts whose interface is named differently."
        )
    return chosen


def plan(
    links: Sequence[AgentLink], iface: str, options: LaunchOptions
) -> tuple[str, dict[str, dict[str, str]]]:
    """The rendezvous address every host can reach, and per-host interface variables."""
    return network.plan_network(
        {lk.host.name: lk.hello.get("interfaces", []) for lk in links if lk.hello},
        iface,
        secure=enclave_ready(options.settings),
        candidates=options.interface_candidates,
    )
