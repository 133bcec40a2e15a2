"""docs/launch.md: the launcher picks each host's interface for Gloo, but a ``GLOO_SOCKET_IFNAME``
set in the launcher's environment wins on every host (a remote one included)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ringtrain import cli
from ringtrain.host.network import Interface
from ringtrain.launch.command import options_from_args
from ringtrain.launch.hosts import Host
from ringtrain.launch.supervisor import Supervisor


def _rank_envs(env: dict[str, str]) -> dict[str, dict[str, str]]:
    """Each remote host's rank environment, as the launcher would send it to the agents."""
    argv = ["run", "-np", "2", "-H", "h0:1,h1:1", "--network-interface", "ib0", "true"]
    sup = Supervisor(options_from_args(cli.build_parser(argv).parse_args(argv)), env=env)
    sent: dict[str, Any] = {}
    sup.links = [
        SimpleNamespace(
            host=Host(h, 1),
            hello={
                "facts": {"hostname": h, "cpus": [0, 1]},
                "interfaces": [Interface("ib0", f"198.19.0.1{i}", 24).to_dict()],
            },
            send=lambda kind, h=h, **msg: sent.setdefault(h, msg),
        )
        for i, h in enumerate(("h0", "h1"))
    ]
    sup._start_ranks(port=12345)
    return {h: msg["ranks"][0]["env"] for h, msg in sent.items()}


def test_a_gloo_socket_ifname_the_user_set_wins_over_the_launchers_choice() -> None:
    chosen = _rank_envs({"PATH": "/usr/bin"})
    assert {h: e["GLOO_SOCKET_IFNAME"] for h, e in chosen.items()} == {"h0": "ib0", "h1": "ib0"}
    mine = _rank_envs({"PATH": "/usr/bin", "GLOO_SOCKET_IFNAME": "mine0"})
    assert {h: e["GLOO_SOCKET_IFNAME"] for h, e in mine.items()} == {"h0": "mine0", "h1": "mine0"}
    # Only the variable set wins: NCCL's and ringtrain's still name the launcher's choice.
    assert {e["NCCL_SOCKET_IFNAME"] for e in mine.values()} == {"ib0"}
    assert {e["RINGTRAIN_NETWORK_INTERFACE"] for e in mine.values()} == {"ib0"}
