"""The launcher's pure parts: host specs, the plan, rank variables, CPU tuning, flag mapping;
and one real run, of this machine named by its hostname."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from ringtrain import cli
from ringtrain.errors import ConfigError, HostSpecError, LaunchError
from ringtrain.launch import agent_start, rank_env
from ringtrain.launch.command import options_from_args
from ringtrain.launch.hosts import Host, parse_hostfile, parse_hosts
from ringtrain.launch.options import SshOptions
from ringtrain.launch.plan import describe, plan
from ringtrain.launch.tuning import HostFacts, tune


def test_parse_hosts() -> None:
    assert parse_hosts("a:2,b:2") == [Host("a", 2), Host("b", 2)]
    assert parse_hosts("a, user@10.0.0.2:3") == [Host("a", 1), Host("user@10.0.0.2", 3)]


def test_this_machines_own_hostname_is_a_local_host() -> None:
    """A hostfile that lists the launch node by name (``hostname``'s output) runs its ranks
    here, with no ssh to itself, as Horovod does; another name is still reached over ssh."""
    own = socket.gethostname()
    for name in {own, own.split(".")[0]}:
        assert Host(name, 2).is_local
        assert "ssh" not in agent_start.command_for(Host(name, 2), SshOptions(), "python", "/")
    assert not Host(f"not-{own}", 2).is_local and not Host(f"me@{own}", 2).is_local
    run = [sys.executable, "-m", "ringtrain", "run", "-H", f"{own}:2", "--"]
    done = subprocess.run(
        [*run, sys.executable, "-c", "print('up')"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.count("up") == 2, done.stderr


@pytest.mark.parametrize(
    ("spec", "quoted"),
    [("a:x", "'a:x'"), ("a:0", "'a:0'"), ("a,,b", "a,,b"), ("a b:2", "'a b:2'"), ("a,a", "'a'")],
)
def test_bad_host_specs_quote_the_token(spec: str, quoted: str) -> None:
    with pytest.raises(HostSpecError) as e:
        parse_hosts(spec)
    assert quoted in str(e.value)


@pytest.mark.parametrize(
    "spec",
    ["localhost:1,127.0.0.1:1", f"127.0.0.1:2,{socket.gethostname()}:2", "local,localhost:3"],
)
def test_this_machine_under_two_names_is_refused(spec: str, tmp_path) -> None:
    """``-H localhost:1,127.0.0.1:1`` ran two agents here, each sure it had a host of its own:
    both ranks got local_rank 0 (the same GPU under ``set_device(local_rank())``) and the same
    cores. Like a host listed twice, it is refused, with the sum of the slots to give."""
    first, second = (t.rpartition(":")[0] or t for t in spec.split(","))
    with pytest.raises(HostSpecError) as e:
        parse_hosts(spec, "-H")
    said = str(e.value)
    assert f"{first!r} and {second!r} both name this machine" in said, said
    assert "local_rank" in said and "HINT: give this machine once" in said, said
    (tmp_path / "hosts").write_text(spec.replace(",", "\n"))
    with pytest.raises(HostSpecError, match="both name this machine"):
        parse_hostfile(tmp_path / "hosts")
    assert parse_hosts("localhost:2,a:1") == [Host("localhost", 2), Host("a", 1)]
    argv = [sys.executable, "-m", "ringtrain", "run", "-H", spec, "-np", "2", "--", "true"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "both name this machine" in done.stderr, done.stderr


def test_hostfile(tmp_path) -> None:
    f = tmp_path / "hosts"
    f.write_text("# cluster\n\nnode1 slots=4\nnode2 slots=2  # half\nnode3:1\n")
    assert parse_hostfile(f) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]
    f.write_text("node1 cores=4\n")
    with pytest.raises(HostSpecError, match=r"hosts:1: cannot parse 'node1 cores=4'"):
        parse_hostfile(f)
    with pytest.raises(HostSpecError, match="cannot read hostfile"):
        parse_hostfile(tmp_path / "missing")
    f.write_text("node1 slots=4\n", encoding="utf-16")  # a Windows editor's "Unicode"
    with pytest.raises(HostSpecError, match="is not UTF-8 text"):
        parse_hostfile(f)


def test_plan_is_host_major_with_horovod_numbering() -> None:
    specs = plan(8, [Host("a", 4), Host("b", 3), Host("c", 1)], ["python", "x.py"])
    assert [(s.rank, s.host, s.local_rank, s.local_size) for s in specs][:5] == [
        (0, "a", 0, 4),
        (1, "a", 1, 4),
        (2, "a", 2, 4),
        (3, "a", 3, 4),
        (4, "b", 0, 3),
    ]
    # Cross groups: ranks sharing a local rank, one per host that has it (4-3-1 is uneven).
    cross = {s.rank: (s.cross_rank, s.cross_size) for s in specs}
    assert cross[0] == (0, 3) and cross[4] == (1, 3) and cross[7] == (2, 3)
    assert cross[1] == (0, 2) and cross[5] == (1, 2)
    assert cross[3] == (0, 1)
    assert describe(specs) == "8 ranks: a ranks 0-3, b ranks 4-6, c rank 7"


def test_round_robin_deals_ranks_out_one_per_host() -> None:
    hosts = [Host("a", 4), Host("b", 3), Host("c", 1)]
    specs = plan(8, hosts, ["x"], placement="round-robin")
    assert [s.host for s in specs] == ["a", "b", "c", "a", "b", "a", "b", "a"]
    assert [(s.local_rank, s.local_size) for s in specs][:4] == [(0, 4), (0, 3), (0, 1), (1, 4)]
    cross = {s.rank: (s.cross_rank, s.cross_size) for s in specs}
    assert cross[0] == (0, 3) and cross[1] == (1, 3) and cross[2] == (2, 3)
    assert cross[3] == (0, 2) and cross[4] == (1, 2) and cross[7] == (0, 1)
    assert describe(specs) == "8 ranks: a ranks 0,3,5,7, b ranks 1,4,6, c rank 2"
    # The same hosts and slots as host-major, only the rank order differs.
    major = plan(8, hosts, ["x"])
    assert sorted(s.host for s in specs) == sorted(s.host for s in major)
    assert [s.host for s in plan(3, [Host("a", 2), Host("b", 2)], ["x"], "round-robin")] == [
        "a",
        "b",
        "a",
    ]
    with pytest.raises(LaunchError, match="placement"):
        plan(2, hosts, ["x"], placement="scatter")
    assert _options("--placement", "round-robin", "-H", "a:2,b:2", "x").placement == "round-robin"


def test_plan_drops_unused_hosts_and_refuses_too_many_ranks() -> None:
    assert {s.host for s in plan(2, [Host("a", 2), Host("b", 2)], ["x"])} == {"a"}
    with pytest.raises(LaunchError, match=r"-np 5 needs 5 slots but the hosts offer 4"):
        plan(5, [Host("a", 2), Host("b", 2)], ["x"])


def test_rank_env_has_both_spellings() -> None:
    spec = plan(4, [Host("a", 2), Host("b", 2)], ["x"])[3]
    env = rank_env.placement(spec, rank_env.Rendezvous("10.0.0.1", 1234, "job"))
    assert env["RINGTRAIN_RANK"] == env["HOROVOD_RANK"] == "3"
    assert env["HOROVOD_LOCAL_RANK"] == "1" and env["HOROVOD_CROSS_RANK"] == "1"
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1"
    assert env["RINGTRAIN_RENDEZVOUS_HOSTED"] == "1"


def test_only_declared_variables_are_forwarded() -> None:
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "SECRET_TOKEN": "s", "MY_VAR": "1"}
    env["ATEN_CPU_CAPABILITY"] = "avx2"  # the same kernels on every host
    out = rank_env.forwarded(env, ["MY_VAR", "EXTRA=x", "UNSET"])
    assert out == {
        "PATH": "/bin",
        "OMP_NUM_THREADS": "2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MY_VAR": "1",
        "EXTRA": "x",
    }


def test_tuning_binds_cores_when_each_rank_gets_one() -> None:
    facts = HostFacts("h", cpus=tuple(range(8)), allocators={"jemalloc": "/lib/libjemalloc.so.2"})
    t = tune(facts, 2, "auto", "jemalloc", {})
    assert t[0].cpus == (0, 1, 2, 3) and t[1].cpus == (4, 5, 6, 7)
    assert t[0].env == {"OMP_NUM_THREADS": "4", "LD_PRELOAD": "/lib/libjemalloc.so.2"}
    # Oversubscribed: no binding, one thread each; the user's own OMP_NUM_THREADS wins.
    t = tune(HostFacts("h", cpus=(0, 1)), 4, "auto", "system", {})
    assert t[0].cpus is None and t[0].env["OMP_NUM_THREADS"] == "1"
    assert tune(facts, 2, "none", "system", {"OMP_NUM_THREADS": "3"})[0].env == {}
    # Binding asked for anyway: one core each, in turn, never an empty set.
    t = tune(HostFacts("h", cpus=(0, 1)), 3, "core", "system", {})
    assert [r.cpus for r in t] == [(0,), (1,), (0,)]


def test_ranks_joining_a_host_the_job_runs_on_share_its_cores_with_the_ranks_there() -> None:
    """An elastic job grows onto a host where 2 of its ranks already hold the 8 cores: the new
    rank binds to none and takes 2 of the 8 threads (8 // 3), not all 8 (it took 8 before)."""
    facts = HostFacts("h", cpus=tuple(range(8)))
    (alone,) = tune(facts, 1, "auto", "system", {})
    assert alone.cpus == tuple(range(8)) and alone.env["OMP_NUM_THREADS"] == "8"
    (joiner,) = tune(facts, 1, "auto", "system", {}, beside=2)
    assert joiner.cpus is None and joiner.env["OMP_NUM_THREADS"] == "2"  # 8 cores, 3 ranks
    assert "bind=none" in joiner.summary and "beside=2 running rank(s)" in joiner.summary
    both = tune(facts, 2, "core", "system", {}, beside=2)  # binding asked for: the cores are held
    assert [(t.cpus, t.env["OMP_NUM_THREADS"]) for t in both] == [(None, "2"), (None, "2")]
    quota = HostFacts("h", cpus=tuple(range(8)), cpu_quota=4.0)  # the quota's share, if lower
    assert tune(quota, 1, "auto", "system", {}, beside=1)[0].env["OMP_NUM_THREADS"] == "2"
    assert tune(facts, 1, "auto", "system", {"OMP_NUM_THREADS": "5"}, beside=2)[0].env == {}


def test_tuning_numa_and_missing_allocator() -> None:
    facts = HostFacts("h", cpus=tuple(range(4)), numa_nodes=((0, 1), (2, 3)))
    assert [t.cpus for t in tune(facts, 2, "numa", "system", {})] == [(0, 1), (2, 3)]
    with pytest.raises(LaunchError, match="no tcmalloc library found on host h"):
        tune(facts, 1, "none", "tcmalloc", {})


def test_ssh_argv_quotes_once_and_keeps_host_key_checking() -> None:
    argv = agent_start.ssh_argv(
        Host("node1", 1), SshOptions(port=2222, config_file="/c"), ["py", "-m", "x y"], "/w d"
    )
    assert argv[:2] == ["ssh", "-o"] and "-F" in argv and "2222" in argv
    assert not any("StrictHostKeyChecking" in a for a in argv)
    assert argv[-2] == "node1"
    assert argv[-1] == "cd '/w d' 2>/dev/null || cd; exec py -m 'x y'"
    relaxed = agent_start.ssh_argv(Host("n", 1), SshOptions(accept_new_host_keys=True), ["p"], "/")
    assert "StrictHostKeyChecking=accept-new" in relaxed


def test_ssh_keepalive_sets_how_soon_a_silent_host_is_lost() -> None:
    keep = _options("-H", "a:1,b:1", "--ssh-keepalive", "2", "true").ssh
    assert keep.keepalive_s == 2
    argv = agent_start.ssh_argv(Host("a", 1), keep, ["p"], "/")
    assert "ServerAliveInterval=2" in argv and "ServerAliveCountMax=3" in argv
    default = agent_start.ssh_argv(Host("a", 1), SshOptions(), ["p"], "/")
    assert "ServerAliveInterval=5" in default and "ServerAliveCountMax=3" in default


def _options(*argv: str):
    parser = cli.build_parser(["run", *argv])
    return options_from_args(parser.parse_args(["run", *argv]))


def test_flags_map_onto_settings() -> None:
    o = _options("-np", "2", "--fusion-threshold-mb", "8", "--secure", "--", "python", "t.py")
    assert o.np == 2 and o.command == ("python", "t.py")
    assert o.settings == {"fusion_threshold_bytes": 8 * 1024 * 1024, "secure": True}
    assert o.hosts == (Host("localhost", 2),) and o.is_local
    o = _options("-H", "a:2,b:1", "python", "t.py")
    assert o.np == 3 and not o.is_local


def test_flag_errors() -> None:
    with pytest.raises(ConfigError, match="how many ranks"):
        _options("python", "t.py")
    with pytest.raises(ConfigError, match="needs --min-np"):  # not "how many ranks" first
        _options("--host-discovery-script", "./hosts.sh", "python", "t.py")
    with pytest.raises(ConfigError, match="no command to run"):
        _options("-np", "2")
    with pytest.raises(ConfigError, match="--check runs its own smoke job"):
        _options("-np", "2", "--check", "python")
    with pytest.raises(ConfigError, match="-x '1BAD'"):
        _options("-np", "1", "-x", "1BAD", "true")


@pytest.mark.parametrize(
    "argv",
    [
        ("python", "t.py"),  # neither -np nor hosts whose slots count the ranks
        ("-np", "2", "--check", "python"),
        ("--host-discovery-script", "./hosts.sh", "-H", "a:1", "--min-np", "1", "python"),
        ("--host-discovery-script", "./hosts.sh", "python"),  # neither -np nor --min-np
        ("-np", "4", "--min-np", "5", "python"),  # an elastic range out of order
    ],
)
def test_flag_errors_end_with_a_hint_line(argv: tuple[str, ...]) -> None:
    """docs/launch.md: a bad flag ends the run with what was wrong, then a ``HINT:`` line."""
    with pytest.raises(ConfigError) as info:
        _options(*argv)
    what, _, hint = str(info.value).partition("\nHINT: ")
    assert what and "HINT" not in what and hint, str(info.value)
