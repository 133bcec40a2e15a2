"""``ringtrain run --host-discovery-script``: the world grows onto offered slots, shrinks off
hosts no longer offered, failing hosts are excluded for a cool-down, and fewer than --min-np
ranks for longer than --elastic-timeout ends the job with a message naming what is missing.

On one machine: ``localhost`` and ``127.0.0.1`` are two local "hosts" to the launcher (each gets
its own agent), which is enough to tell hosts apart. The same on real ssh hosts is in
``tests/cluster/test_elastic_discovery_cluster.py``.
"""

from __future__ import annotations

import queue
import re
from pathlib import Path

import pytest

from _elastic_grow import EXPECTED, fields, run_job, script
from ringtrain.errors import ConfigError, LaunchError
from ringtrain.launch import discovery
from ringtrain.launch.hosts import Host
from ringtrain.launch.options import LaunchOptions

# ---- units -----------------------------------------------------------------------------------


def test_script_output_is_parsed_as_horovodrun_does() -> None:
    hosts = discovery.parse("a:4\n\nb\n  c:2 \na:4\n", slots_per_host=3)
    assert hosts == [Host("a", 4), Host("b", 3), Host("c", 2)]
    assert discovery.parse("", 1) == []  # nothing ready yet is not an error
    with pytest.raises(LaunchError, match="printed 'a:x'"):
        discovery.parse("a:x\n", 1)


def test_a_failing_script_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="exited with code 3: no hosts today"):
        discovery.run_script("echo no hosts today >&2; exit 3", 1)


def test_the_poller_reruns_the_script_and_reports_failures(tmp_path: Path) -> None:
    """Every second: a failing run is handed on as the error (the launcher says it and keeps
    the hosts it had), the next run's hosts follow."""
    count = tmp_path / "count"
    cmd = (
        f"n=$(cat {count} 2>/dev/null || echo 0); echo $((n+1)) > {count}; "
        '[ "$n" = 0 ] && { echo broken >&2; exit 2; }; echo "a:$n"'
    )
    got: queue.Queue[object] = queue.Queue()
    poller = discovery.Poller(cmd, 1, got.put)
    poller.start()
    try:
        first, second = got.get(timeout=30), got.get(timeout=30)
    finally:
        poller.stop()
    assert isinstance(first, LaunchError) and "exited with code 2: broken" in str(first)
    assert second == [Host("a", 1)]


def test_exclusion_cooldown_grows_with_each_failure_within_the_range() -> None:
    now = [100.0]
    ex = discovery.Exclusions((2.0, 20.0), clock=lambda: now[0], jitter=lambda: 0.5)
    assert ex.fail("h") == 5.0  # 2 * 2**1 + 0.5 * 2
    assert ex.excluded("h") and not ex.excluded("other")
    now[0] += 5.0
    assert not ex.excluded("h")
    assert ex.fail("h") == 9.0  # 2 * 2**2 + 1
    assert ex.fail("h") == 17.0
    assert ex.fail("h") == 20.0  # capped at MAX
    assert ex.failures("h") == 4
    forever = discovery.Exclusions(None, clock=lambda: now[0])
    assert forever.fail("h") is None
    now[0] += 1e9
    assert forever.excluded("h") and forever.remaining_s("h") == float("inf")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"hosts": (Host("a", 1),)}, "not both"),
        ({"min_np": None}, "needs --min-np"),
        ({"cooldown_range": (0.5, 10.0)}, "1 <= MIN <= MAX <= 3600"),
        ({"slots_per_host": 0}, "--slots-per-host"),
    ],
)
def test_discovery_flags_are_checked(kw: dict[str, object], match: str) -> None:
    base: dict[str, object] = {
        "np": 2,
        "hosts": (),
        "command": ("x",),
        "min_np": 2,
        "discovery_script": "d.sh",
    }
    with pytest.raises(ConfigError, match=match):
        LaunchOptions(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_a_script_failing_at_start_ends_the_job(tmp_path: Path) -> None:
    proc = run_job(tmp_path, ["-np", "2", "--min-np", "2", "--host-discovery-script", "exit 5"])
    assert proc.returncode == 1, proc.stderr
    assert "--host-discovery-script 'exit 5' exited with code 5" in proc.stderr
    assert "[0]" not in proc.stdout


# ---- jobs ------------------------------------------------------------------------------------


@pytest.mark.timeout(420)
def test_a_slot_offered_later_joins_and_the_world_grows(tmp_path: Path) -> None:
    """2 ranks, then the script offers two more slots but --max-np is 3: one new rank joins at
    the commit where the others wait, receives the state by broadcast, and all three end with
    the exact result."""
    disc = script(tmp_path, "localhost:2\\n", "localhost:4\\n")
    proc = run_job(
        tmp_path,
        ["-v", "-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", disc],
        HOLD_AT="6",  # 24 samples processed: the 36 left split evenly over 3 ranks
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pids = {s["id"]: s["pid"] for s in fields(proc.stdout, "start")}
    done = fields(proc.stdout, "done")
    assert sorted(d["id"] for d in done) == ["0", "1", "2"]
    for d in done:
        assert d["pid"] == pids[d["id"]] and d["size"] == "3" and d["gen"] == "1"
        assert d["w"] == EXPECTED
    assert sorted(d["rank"] for d in done) == ["0", "1", "2"]
    assert [d["id"] for d in sorted(done, key=lambda d: d["rank"])] == ["0", "1", "2"]
    assert len(fields(proc.stdout, "start")) == 3  # no restart: one start per rank
    assert "host localhost offers 1 free slot(s): starting rank(s) [2] to join" in proc.stderr
    assert "growing the world to 3 rank(s) [0, 1, 2] (generation 1)" in proc.stderr
    # It shares the host's cores with the two ranks there (launch.tuning; threads: the test's).
    assert "rank 2 on localhost: bind=none cpus=any" in proc.stderr, proc.stderr
    assert "beside=2 running rank(s)" in proc.stderr, proc.stderr


@pytest.mark.timeout(420)
def test_a_rank_joining_a_secure_job_joins_its_sealed_world(tmp_path: Path) -> None:
    """--secure: the new rank starts on a host whose agent the launcher starts only then
    (127.0.0.1), authenticates with the job's key, and the grown world is sealed on every rank
    (fresh session keys for generation 1), with the exact result."""
    disc = script(tmp_path, "localhost:2\\n", "localhost:2\\n127.0.0.1:1\\n")
    flags = ["-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", disc]
    proc = run_job(tmp_path, ["--secure", *flags], HOLD_AT="6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "host 127.0.0.1 offers 1 free slot(s): starting rank(s) [2] to join" in proc.stderr
    assert "growing the world to 3 rank(s) [0, 1, 2] (generation 1)" in proc.stderr
    done = fields(proc.stdout, "done")
    assert sorted(d["id"] for d in done) == ["0", "1", "2"], proc.stdout + proc.stderr
    for d in done:
        assert d["size"] == "3" and d["gen"] == "1" and d["w"] == EXPECTED
        assert d["backend"] == "ringtrain_sealed", d


@pytest.mark.timeout(420)
@pytest.mark.parametrize("how", ["create", "posted"])
def test_a_new_rank_lost_while_the_grown_world_forms_leaves_it_at_once(
    tmp_path: Path, how: str
) -> None:
    """The new rank on 127.0.0.1 is announced, arrives, and dies as the grown world makes its
    groups: before it posted an address (``create``) or right after (``posted``; before
    runtime/forming_gather this waited for the transport timeout, 300 s). Ranks 0 and 1 join the
    world announced without it and finish with the exact result."""
    disc = script(tmp_path, "localhost:2\\n", "localhost:2\\n127.0.0.1:1\\n")
    flags = ["-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", disc]
    cooldown = ["--blacklist-cooldown-range", "600", "600"]  # no second try within the job
    proc = run_job(tmp_path, [*flags, *cooldown], HOLD_AT="6", JOIN_FORMING_VICTIM=how)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "growing the world to 3 rank(s) [0, 1, 2] (generation 1)" in proc.stderr
    died = fields(proc.stdout, "dying")
    assert died, proc.stdout  # it died where the test meant it to
    resets = [float(r["t"]) for r in fields(proc.stdout, "reset")]
    assert len(resets) == 2 and max(resets) - float(died[0]["t"]) < 60, proc.stdout
    said = proc.stdout + proc.stderr
    assert said.count("generation 2 was announced while init()") == 2, said
    done = fields(proc.stdout, "done")
    assert sorted(d["id"] for d in done) == ["0", "1"], said
    assert all(d["w"] == EXPECTED and d["size"] == "2" and d["gen"] == "2" for d in done)


@pytest.mark.timeout(420)
def test_a_host_no_longer_offered_leaves_the_world(tmp_path: Path) -> None:
    disc = script(tmp_path, "localhost:2\\n127.0.0.1:1\\n", "localhost:2\\n")
    proc = run_job(
        tmp_path,
        ["-np", "3", "--min-np", "2", "--host-discovery-script", disc],
        HOLD_AT="4",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = fields(proc.stdout, "done")
    assert sorted(d["id"] for d in done) == ["0", "1"]
    for d in done:
        assert d["size"] == "2" and d["w"] == EXPECTED
    assert (
        "host(s) 127.0.0.1 no longer offered by the discovery script: removing rank(s) [2]; "
        "re-forming the world with the 2 remaining rank(s) [0, 1]"
    ) in proc.stderr


@pytest.mark.timeout(420)
def test_a_failing_host_is_excluded_for_a_growing_cooldown(tmp_path: Path) -> None:
    """Every rank started on 127.0.0.1 fails: each time the host is excluded, longer; the
    two ranks on localhost hold until it failed twice, then finish undisturbed."""
    disc = script(tmp_path, "localhost:2\\n127.0.0.1:1\\n", "localhost:2\\n127.0.0.1:1\\n")
    proc = run_job(
        tmp_path,
        [
            "-np",
            "2",
            "--min-np",
            "2",
            "--max-np",
            "3",
            "--host-discovery-script",
            disc,
            "--blacklist-cooldown-range",
            "1",
            "8",
        ],
        HOLD_AT="4",
        HOLD_FOR_LINES="2",
        FAIL_HOST="127.0.0.1",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = fields(proc.stdout, "done")
    assert sorted(d["id"] for d in done) == ["0", "1"]
    assert all(d["w"] == EXPECTED and d["size"] == "2" for d in done)
    spans = [
        float(s)
        for s in re.findall(
            r"excluding host 127\.0\.0\.1 for ([\d.]+) s after failure \d of its ranks: rank \d+ "
            r"\(host 127\.0\.0\.1, pid \d+\) exited with code 1",
            proc.stderr,
        )
    ]
    assert len(spans) >= 2, proc.stderr
    assert 2.0 <= spans[0] <= 3.0 and 4.0 <= spans[1] <= 5.0  # 1 s * 2**n, + up to 1 s
    assert "growing the world" not in proc.stderr


@pytest.mark.timeout(420)
def test_below_min_np_a_host_offered_in_time_replaces_the_lost_rank(tmp_path: Path) -> None:
    """Rank 1 dies (its host is excluded), leaving 1 of --min-np 2; the script then offers
    another host: the new rank joins the survivor, which restored its last commit, and both end
    with the exact result."""
    disc = script(tmp_path, "localhost:2\\n", "localhost:2\\n127.0.0.1:1\\n")
    proc = run_job(
        tmp_path,
        ["-np", "2", "--min-np", "2", "--host-discovery-script", disc, "--elastic-timeout", "300"],
        VICTIM="1",
        SIGNAL_ON_KILL="1",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    err = proc.stderr
    assert "1 rank(s) remain, fewer than --min-np 2: waiting up to 300 s" in err
    assert "excluding host localhost for the rest of the job" in err
    assert "growing the world to 2 rank(s) [0, 2] (generation 1)" in err
    pids = {s["id"]: s["pid"] for s in fields(proc.stdout, "start")}
    done = fields(proc.stdout, "done")
    assert sorted(d["id"] for d in done) == ["0", "2"]
    for d in done:
        assert d["pid"] == pids[d["id"]] and d["size"] == "2" and d["w"] == EXPECTED


@pytest.mark.timeout(420)
def test_below_min_np_past_the_elastic_timeout_ends_the_job_naming_what_is_missing(
    tmp_path: Path,
) -> None:
    disc = script(tmp_path, "localhost:3\\n", "localhost:3\\n")
    proc = run_job(
        tmp_path,
        [
            "-np",
            "3",
            "--min-np",
            "3",
            "--host-discovery-script",
            disc,
            "--elastic-timeout",
            "1",  # the shortest: the wait's length is not what this test shows
        ],
        VICTIM="1",
    )
    assert proc.returncode == 137, proc.stdout + proc.stderr
    err = proc.stderr
    assert "waiting up to 1 s (--elastic-timeout) for the discovery script to offer hosts" in err
    assert (
        "fewer than --min-np 3 ranks for 1 s (--elastic-timeout): 2 remain "
        "(rank(s) 0 on localhost, 2 on localhost), 1 more needed"
    ) in err
    assert re.search(r"left: rank 1 \(host localhost, pid \d+\) was killed by SIGKILL", err)
    assert "excluded hosts: localhost (for good)" in err
    assert "the discovery script offers: localhost:3" in err
    assert "[0] done" not in proc.stdout


@pytest.mark.timeout(300)
def test_without_a_discovery_script_below_min_np_ends_at_once_naming_what_is_missing(
    tmp_path: Path,
) -> None:
    # --elastic-timeout waits for hosts a discovery script may offer; without a script the
    # job ends at once whatever its value.
    flags = ["-np", "3", "--min-np", "3", "--elastic-timeout", "60"]
    proc = run_job(tmp_path, flags, VICTIM="1")
    assert proc.returncode == 137, proc.stdout + proc.stderr
    assert re.search(r"rank 1 \(host localhost, pid \d+\) was killed by SIGKILL", proc.stderr)
    assert (
        "fewer than --min-np 3 ranks remain (2 left: rank(s) 0 on localhost, 2 on localhost; "
        "1 more needed; no --host-discovery-script can add hosts)"
    ) in proc.stderr
    # The launcher does not wait (the ranks, told nothing yet, say they wait for a new world).
    launcher_waits = [
        x for x in proc.stderr.splitlines() if x.startswith("ringtrain run:") and "waiting" in x
    ]
    assert not launcher_waits and "[0] done" not in proc.stdout, proc.stderr


@pytest.mark.timeout(120)
def test_too_few_slots_at_start_end_the_job_after_the_elastic_timeout(tmp_path: Path) -> None:
    disc = script(tmp_path, "localhost:1\\n", "localhost:1\\n")
    proc = run_job(
        tmp_path,
        ["-np", "2", "--min-np", "2", "--host-discovery-script", disc, "--elastic-timeout", "1"],
    )
    assert proc.returncode == 1, proc.stderr
    assert (
        "timed out after 1 s (--elastic-timeout) waiting for --min-np 2 slots: "
        "the discovery script offers 1 (localhost:1)"
    ) in proc.stderr
    assert "[0]" not in proc.stdout
