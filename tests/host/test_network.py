"""Interface discovery and choice: pure tests on synthetic interface lists, plus this machine."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

from ringtrain.errors import ConfigError, LaunchError
from ringtrain.host import network
from ringtrain.host.network import Interface, choose, plan_network, resolve_spec

LO = Interface("lo", "127.0.0.1", 8, is_loopback=True)
DOCKER0 = Interface("docker0", "172.17.0.1", 16, flags=("bridge", "docker", "virtual"))


def eth(name: str, address: str, prefixlen: int = 24, **kw) -> Interface:
    return Interface(name, address, prefixlen, **kw)


def cluster_view() -> dict[str, list[Interface]]:
    """Three hosts on 198.18.0.0/24 with different names, each with its own docker0."""
    return {
        "h0": [LO, DOCKER0, eth("eth0", "198.18.0.10")],
        "h1": [DOCKER0, LO, eth("eth7", "198.18.0.11")],
        "h2": [LO, eth("eth0", "198.18.0.12"), DOCKER0],
    }


def names(chosen: dict[str, Interface]) -> dict[str, str]:
    return {h: i.name for h, i in chosen.items()}


# ---- choose ---------------------------------------------------------------------------------


def test_choose_finds_the_shared_subnet_whatever_the_names() -> None:
    chosen = choose(cluster_view())
    assert names(chosen) == {"h0": "eth0", "h1": "eth7", "h2": "eth0"}
    assert [i.address for i in chosen.values()] == ["198.18.0.10", "198.18.0.11", "198.18.0.12"]


def test_choose_never_takes_a_subnet_where_hosts_share_an_address() -> None:
    # Every host's docker0 is 172.17.0.1/16: "shared" by all, routed between none.
    view = {h: [LO, DOCKER0] for h in ("a", "b")}
    with pytest.raises(LaunchError) as e:
        choose(view)
    msg = str(e.value)
    assert "a, b all have 172.17.0.1" in msg
    assert "a: docker0 172.17.0.1/16" in msg and "HINT: pass --network-interface" in msg


def test_choose_never_takes_loopback_even_alone() -> None:
    with pytest.raises(LaunchError, match="a: no IPv4 addresses"):
        choose({"a": [LO], "b": [LO]})


def test_choose_prefers_a_plain_interface_over_a_bridge_on_the_same_footing() -> None:
    br = eth("br0", "10.1.0.5", flags=("bridge", "virtual"))
    view = {
        "a": [br, eth("eth1", "10.2.0.5")],
        "b": [eth("br0", "10.1.0.6", flags=("bridge",)), eth("eth1", "10.2.0.6")],
    }
    assert names(choose(view)) == {"a": "eth1", "b": "eth1"}


def test_choose_uses_a_bridge_when_it_is_the_routed_network() -> None:
    # Hypervisors often carry their real address on a bridge: allowed when all hosts share it.
    view = {
        "a": [eth("br0", "10.1.0.5", flags=("bridge",)), DOCKER0],
        "b": [eth("eno1", "10.1.0.6"), DOCKER0],
    }
    assert names(choose(view)) == {"a": "br0", "b": "eno1"}


def test_choose_skips_down_and_link_local_interfaces() -> None:
    view = {
        "a": [
            eth("eth0", "10.0.0.1", is_up=False),
            eth("eth1", "169.254.3.4", 16),
            eth("ib0", "10.9.0.1"),
        ],
        "b": [eth("eth0", "10.0.0.2"), eth("eth1", "169.254.3.5", 16), eth("ib0", "10.9.0.2")],
    }
    assert names(choose(view)) == {"a": "ib0", "b": "ib0"}


def test_choose_handles_different_prefix_lengths() -> None:
    # a's /16 holds b's address; b's /24 does not hold a's: the /16 is the shared one.
    view = {"a": [eth("eth0", "10.0.0.5", 16)], "b": [eth("eth0", "10.0.1.7", 24)]}
    assert names(choose(view)) == {"a": "eth0", "b": "eth0"}


def test_choose_is_deterministic_whatever_the_order() -> None:
    view = {
        "a": [eth("eth0", "10.0.0.1"), eth("eth1", "10.1.0.1")],
        "b": [eth("eth1", "10.1.0.2"), eth("eth0", "10.0.0.2")],
    }
    first = choose(view)
    reordered = {h: list(reversed(v)) for h, v in reversed(list(view.items()))}
    assert choose(reordered) == first
    assert names(first) == {"a": "eth0", "b": "eth0"}


def test_choose_respects_probed_reachability() -> None:
    view = {
        "a": [eth("eth0", "10.0.0.1"), eth("eth1", "10.1.0.1")],
        "b": [eth("eth0", "10.0.0.2"), eth("eth1", "10.1.0.2")],
    }
    # A firewall drops 10.0.0.0/24 from a to b: only 10.1.0.0/24 works.
    reached = {"a": {"10.1.0.2"}, "b": {"10.0.0.1", "10.1.0.1"}}
    assert names(choose(view, reached)) == {"a": "eth1", "b": "eth1"}
    with pytest.raises(LaunchError) as e:
        choose(view, lambda src, addr: src == "b")
    assert "a cannot reach b's 10.0.0.2 (eth0)" in str(e.value)
    assert "a cannot reach b's 10.1.0.2 (eth1)" in str(e.value)


def test_no_common_subnet_says_which_host_has_what() -> None:
    view = {"a": [LO, eth("eth0", "10.0.0.1")], "b": [eth("eth7", "192.168.5.2")]}
    with pytest.raises(LaunchError) as e:
        choose(view)
    msg = str(e.value)
    assert "a: eth0 10.0.0.1/24\n" in msg
    assert "b: eth7 192.168.5.2/24" in msg
    assert "--network-interface NAME" in msg and "CIDR" in msg


def test_host_without_interfaces_is_named() -> None:
    with pytest.raises(LaunchError, match=r"host\(s\) b reported no network interfaces"):
        choose({"a": [eth("eth0", "10.0.0.1")], "b": []})


def test_single_host_takes_its_best_interface() -> None:
    assert names(choose({"a": [LO, DOCKER0, eth("eth0", "10.0.0.1")]})) == {"a": "eth0"}


# ---- resolve_spec ---------------------------------------------------------------------------


def test_spec_one_name() -> None:
    view = {"h0": [eth("eth0", "10.0.0.1")], "h1": [LO, eth("eth0", "10.0.0.2")]}
    assert resolve_spec("eth0", view) == {"h0": view["h0"][0], "h1": view["h1"][1]}


def test_spec_per_host_with_default() -> None:
    view = cluster_view()
    chosen = resolve_spec("eth0, h1=eth7", view)
    assert names(chosen) == {"h0": "eth0", "h1": "eth7", "h2": "eth0"}
    assert chosen["h1"].address == "198.18.0.11"
    assert names(resolve_spec("h0=eth0,h1=eth7,h2=docker0", view))["h2"] == "docker0"


def test_spec_cidr_and_address() -> None:
    view = cluster_view()
    assert names(resolve_spec("198.18.0.0/24", view)) == {"h0": "eth0", "h1": "eth7", "h2": "eth0"}
    assert names(resolve_spec("198.18.0.0/16,h1=198.18.0.11", view))["h1"] == "eth7"


def test_spec_name_is_trusted_when_not_enumerated() -> None:
    assert resolve_spec("eth3", {"a": [], "b": []}) == {
        "a": Interface("eth3"),
        "b": Interface("eth3"),
    }


@pytest.mark.parametrize(
    ("spec", "error", "quoted"),
    [
        ("eth0,,eth1", ConfigError, "empty entry"),
        ("h9=eth0,eth0", ConfigError, "'h9=eth0'"),
        ("eth0,eth1", ConfigError, "'eth1' and 'eth0'"),
        ("h0=eth0,h1=eth7", ConfigError, "nothing about host 'h2'"),
        ("10.0.0.0/33", ConfigError, "'10.0.0.0/33'"),
        ("h1=10.0.0.300", ConfigError, "'h1=10.0.0.300'"),
        ("a very long interface name", ConfigError, "'a very long interface name'"),
        ("h0=eth0,h0=eth1,eth0", ConfigError, "host 'h0' is given twice"),
        ("eth7", LaunchError, "host h0 has no interface named 'eth7'"),
        ("10.0.0.0/8", LaunchError, "host h0 has no address in 10.0.0.0/8"),
        ("eth0,h1=198.18.0.99", LaunchError, "host h1 has no interface with address 198.18.0.99"),
    ],
)
def test_bad_specs_quote_the_token(spec: str, error: type[Exception], quoted: str) -> None:
    with pytest.raises(error) as e:
        resolve_spec(spec, cluster_view())
    assert quoted in str(e.value)
    assert "HINT" in str(e.value) or "twice" in str(e.value)


def test_missing_name_lists_what_the_host_has() -> None:
    with pytest.raises(LaunchError) as e:
        resolve_spec("eth0", cluster_view())
    assert "host h1 has no interface named 'eth0'; it has: " in str(e.value)
    assert "eth7 198.18.0.11/24" in str(e.value)


def test_cidr_needs_the_host_list() -> None:
    with pytest.raises(LaunchError, match="host a reported no interfaces"):
        resolve_spec("10.0.0.0/24", {"a": []})


# ---- rendezvous address and the launcher's plan ---------------------------------------------


def test_rendezvous_is_the_launchers_address_on_the_chosen_subnet() -> None:
    chosen = choose(cluster_view())
    launcher = [LO, eth("eth0", "192.0.2.2"), eth("rtbr", "198.18.0.1", flags=("bridge",))]
    assert network.rendezvous_address(chosen, launcher) == "198.18.0.1"


def test_rendezvous_falls_back_to_the_routing_table(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def route(addr: str) -> str:
        seen.append(addr)
        return "10.8.0.3"

    monkeypatch.setattr(network, "route_source", route)
    chosen = choose(cluster_view())
    assert network.rendezvous_address(chosen, [LO, eth("wg0", "10.8.0.3")]) == "10.8.0.3"
    assert seen == ["198.18.0.10"]


def test_rendezvous_error_when_nothing_leads_to_the_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network, "route_source", lambda addr: None)
    monkeypatch.setattr(network, "interface_address", lambda name: None)
    with pytest.raises(LaunchError, match="cannot tell at which address") as e:
        network.rendezvous_address(choose(cluster_view()), [LO])
    assert "h1: eth7 198.18.0.11/24" in str(e.value)


def test_plan_network_from_agent_hellos() -> None:
    hellos = {h: [i.to_dict() for i in ifaces] for h, ifaces in cluster_view().items()}
    launcher = [LO, eth("rtbr", "198.18.0.1", flags=("bridge",))]
    addr, env = plan_network(hellos, "", local=launcher)
    assert addr == "198.18.0.1"
    assert env["h1"] == {
        "RINGTRAIN_NETWORK_INTERFACE": "eth7",
        "GLOO_SOCKET_IFNAME": "eth7",
        "NCCL_SOCKET_IFNAME": "eth7",
    }
    assert env["h0"]["GLOO_SOCKET_IFNAME"] == "eth0"
    addr, env = plan_network(hellos, "h0=eth0,h1=eth7,h2=eth0", local=launcher)
    assert addr == "198.18.0.1" and env["h1"]["GLOO_SOCKET_IFNAME"] == "eth7"


def test_interface_round_trips_through_the_agent_protocol() -> None:
    for i in [LO, DOCKER0, eth("eth7", "198.18.0.11", is_up=False)]:
        assert Interface.from_dict(i.to_dict()) == i
    assert Interface.from_dict({"name": "eth0"}) == Interface("eth0")


def test_secure_mode_with_explicit_interface_enumerates_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_netlink(*a: object, **k: object) -> object:
        raise AssertionError("enumerated interfaces in secure mode with an explicit interface")

    monkeypatch.setattr(psutil, "net_if_addrs", no_netlink)
    monkeypatch.setattr(psutil, "net_if_stats", no_netlink)
    monkeypatch.setattr(network, "local_interfaces", no_netlink)
    monkeypatch.setattr(network, "route_source", lambda addr: "198.18.0.1")
    # The hosts reported their interfaces; the launcher asks only its routing table.
    hellos = {h: [i.to_dict() for i in ifaces] for h, ifaces in cluster_view().items()}
    addr, env = plan_network(hellos, "eth0,h1=eth7", secure=True)
    assert addr == "198.18.0.1"
    assert [e["GLOO_SOCKET_IFNAME"] for e in env.values()] == ["eth0", "eth7", "eth0"]
    # The agents (in enclaves too) reported nothing: the name is taken on trust, and the
    # launcher's address is that interface's own, by one ioctl.
    monkeypatch.setattr(network, "interface_address", lambda name: {"eth0": "10.0.0.9"}.get(name))
    addr, env = plan_network({"h0": [], "h1": []}, "eth0", secure=True)
    assert addr == "10.0.0.9"
    assert env["h0"]["GLOO_SOCKET_IFNAME"] == env["h1"]["GLOO_SOCKET_IFNAME"] == "eth0"
    # Without secure mode the launcher does enumerate (and here that is caught).
    with pytest.raises(AssertionError, match="enumerated"):
        plan_network({"h0": [], "h1": []}, "eth0", secure=False)


# ---- this machine ---------------------------------------------------------------------------


def test_local_interfaces_describe_this_machine() -> None:
    found = network.local_interfaces()
    assert any(i.is_loopback and i.address.startswith("127.") for i in found)
    assert [(i.name, i.address) for i in found] == sorted(
        ((i.name, i.address) for i in found),
        key=lambda t: (t[0], ipaddress.IPv4Address(t[1]) if t[1] else ipaddress.IPv4Address(0)),
    )
    for i in found:
        assert i.name in psutil.net_if_addrs()
        if i.address:
            assert 0 <= i.prefixlen <= 32


def test_route_source_asks_the_routing_table_only() -> None:
    assert network.route_source("127.0.0.1") == "127.0.0.1"
    assert network.interface_address("lo") == "127.0.0.1"
    assert network.interface_address("no-such-if0") is None
