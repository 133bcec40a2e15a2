"""``ringtrain run`` end to end with plain commands: output, failures, Ctrl-C, no survivors.

Ranks here are small Python programs (no torch), so each test takes about a second or two.
Every rank records its pid; every test checks that none of them is still alive afterwards.
"""

from __future__ import annotations

import io
import queue
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from _launcher_runs import assert_gone
from ringtrain import cli
from ringtrain.launch import job_state
from ringtrain.launch.command import options_from_args
from ringtrain.launch.failures import Failure
from ringtrain.launch.hosts import Host
from ringtrain.launch.supervisor import PEER_NOTICE_S, AgentLink, Supervisor

RANK_SCRIPT = textwrap.dedent(
    """
    import os, signal, socket, sys, time
    rank = int(os.environ["RINGTRAIN_RANK"])
    open(os.path.join(sys.argv[1], f"pid.{rank}"), "w").write(str(os.getpid()))
    mode = sys.argv[2]
    print(f"hello from {rank} of {os.environ['HOROVOD_SIZE']}", flush=True)
    if mode == "ok":  # the rest of what horovodrun sets for a rank
        names = "RANK LOCAL_RANK LOCAL_SIZE CROSS_RANK CROSS_SIZE HOSTNAME CONTROLLER"
        names += " CPU_OPERATIONS"
        gloo, ours = ([os.environ.get(f"{p}_RENDEZVOUS_{v}") for v in ("ADDR", "PORT")]
                      for p in ("HOROVOD_GLOO", "RINGTRAIN"))
        print(*(f"{n}={os.environ.get('HOROVOD_' + n)}" for n in names.split()),
              f"GLOO_RENDEZVOUS_IS_THE_STORE={gloo == ours and None not in gloo}")
    if mode == "fail" and rank == 1:
        # Fail once the job's store is up: the launcher waits for it (a torch import, many
        # seconds on a loaded machine) before it acts on the ranks' news.
        store = (os.environ["RINGTRAIN_RENDEZVOUS_ADDR"], os.environ["RINGTRAIN_RENDEZVOUS_PORT"])
        while True:
            try:
                socket.create_connection((store[0], int(store[1])), timeout=1.0).close()
                break
            except OSError:
                time.sleep(0.05)
        time.sleep(0.3)
        open(os.path.join(sys.argv[1], "failed_at"), "w").write(repr(time.time()))
        print("something went wrong on rank 1", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "kill" and rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "stubborn":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode in ("fail", "kill", "sleep", "stubborn"):
        time.sleep(60)
    """
)


def _launch(tmp_path: Path, np: int, mode: str, *flags: str) -> subprocess.Popen[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ringtrain",
            "run",
            "-np",
            str(np),
            *flags,
            "--",
            sys.executable,
            str(script),
            str(tmp_path),
            mode,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_pids(tmp_path: Path, n: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(tmp_path.glob("pid.*"))
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError(f"ranks did not start: {list(tmp_path.iterdir())}")


def _finish(proc: subprocess.Popen[str], timeout: float = 30.0) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"launcher did not finish:\n{out}\n{err}") from None
    return proc.returncode, out, err


def test_success_prefixes_output_and_sets_horovod_variables(tmp_path: Path) -> None:
    proc = _launch(tmp_path, 3, "ok")
    code, out, err = _finish(proc)
    assert code == 0, err
    lines = sorted(out.splitlines())
    assert [x for x in lines if "hello" in x] == [f"[{r}] hello from {r} of 3" for r in range(3)]
    # One host: local = global, one cross group; Gloo does every CPU operation, as in Horovod.
    assert [x for x in lines if "hello" not in x] == [
        f"[{r}] RANK={r} LOCAL_RANK={r} LOCAL_SIZE=3 CROSS_RANK=0 CROSS_SIZE=1 "
        "HOSTNAME=localhost CONTROLLER=gloo CPU_OPERATIONS=gloo GLOO_RENDEZVOUS_IS_THE_STORE=True"
        for r in range(3)
    ]


def test_no_prefix_relays_each_line_bare(tmp_path: Path) -> None:
    """docs/launch.md: ``--no-prefix`` prints the ranks' lines without ``[rank] ``."""
    code, out, err = _finish(_launch(tmp_path, 2, "hello", "--no-prefix"))
    assert code == 0, err
    assert sorted(out.splitlines()) == [f"hello from {r} of 2" for r in range(2)], out


def test_failing_rank_ends_the_job_with_its_code(tmp_path: Path) -> None:
    proc = _launch(tmp_path, 3, "fail")
    pids = _wait_for_pids(tmp_path, 3)
    code, _out, err = _finish(proc)
    assert code == 3
    # From rank 1's failure to the launcher's exit, not waiting out the others' 60 s sleep (the
    # launcher's own start, which a loaded machine stretches, is not part of this).
    assert time.time() - float((tmp_path / "failed_at").read_text()) < 10
    assert "stopping the other 2 rank(s)" in err
    assert "rank 1 (host localhost" in err and "exited with code 3" in err
    assert "| something went wrong on rank 1" in err  # the end of its error output
    assert "[1] something went wrong on rank 1" in err
    assert_gone(pids)


def test_rank_killed_by_a_signal(tmp_path: Path) -> None:
    proc = _launch(tmp_path, 2, "kill")
    pids = _wait_for_pids(tmp_path, 2)
    code, _, err = _finish(proc)
    assert code == 128 + signal.SIGKILL
    assert "rank 1" in err and "was killed by SIGKILL" in err
    assert_gone(pids)


@pytest.mark.parametrize("mode", ["sleep", "stubborn"])
def test_ctrl_c_is_forwarded_and_ends_everything(tmp_path: Path, mode: str) -> None:
    proc = _launch(tmp_path, 2, mode, "--grace-period", "2")
    pids = _wait_for_pids(tmp_path, 2)
    time.sleep(0.2)  # let "stubborn" ranks install their handlers
    proc.send_signal(signal.SIGINT)
    code, _, err = _finish(proc)
    assert code == 130, err
    assert "interrupted" in err
    # Ranks that ignore SIGINT and SIGTERM are SIGKILLed when the grace period ends.
    killed = "did not exit within the grace period of 2 s after SIGINT; killed"
    assert (killed in err) is (mode == "stubborn"), err
    assert_gone(pids)


def test_killing_the_launcher_leaves_no_rank(tmp_path: Path) -> None:
    proc = _launch(tmp_path, 2, "sleep")
    pids = _wait_for_pids(tmp_path, 2)
    proc.kill()
    proc.communicate()
    assert_gone(pids)


def test_command_not_found(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--", "no-such-command-xyz"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 127
    assert "could not start" in proc.stderr and "command not found" in proc.stderr


def test_a_script_that_is_not_executable_is_named_with_what_to_do(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    script.chmod(0o644)
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 126, proc.stderr  # a shell's code: found, but not runnable
    assert f"could not start: cannot start {str(script)!r}: Permission denied" in proc.stderr
    assert f"HINT: {script} is not executable: chmod +x {script}" in proc.stderr
    assert "never runs" not in proc.stdout


def test_a_script_whose_interpreter_is_missing_names_its_interpreter_line(
    tmp_path: Path,
) -> None:
    script = tmp_path / "shebang.py"
    script.write_text("#!/nonexistent/python\nprint('never runs')\n")
    script.chmod(0o755)
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--", "./shebang.py"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 127, proc.stderr  # bash's code for it, too
    assert (
        "cannot start './shebang.py': bad interpreter: its #! line names '/nonexistent/python'"
    ) in proc.stderr
    assert "command not found" not in proc.stderr
    assert "HINT: fix that line" in proc.stderr and "python ./shebang.py" in proc.stderr


def test_a_script_named_without_a_path_is_looked_up_on_path_and_the_hint_says_so(
    tmp_path: Path,
) -> None:
    (tmp_path / "ok.py").write_text("print('never runs')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "-np", "2", "ok.py"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 127, proc.stderr
    assert "cannot start 'ok.py': command not found" in proc.stderr
    assert "HINT: ok.py is a file in the working directory" in proc.stderr
    assert "run python ok.py (or ./ok.py" in proc.stderr
    assert "never runs" not in proc.stdout


def test_bad_flags_give_a_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "-H", "a:x", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "bad slot count in 'a:x'" in proc.stderr and "Traceback" not in proc.stderr


def test_ctrl_c_while_the_subcommand_imports_ends_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before the subcommand takes over its signals, its modules import (seconds on a busy
    # host); Ctrl-C there printed the import machinery's traceback.
    def interrupted(name: str) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["run", "-np", "1", "--", "true"]) == 130


@pytest.mark.parametrize("code", [0, 3])
def test_the_launcher_closes_the_pipes_it_opened(code: int) -> None:
    # Left open, each printed "ResourceWarning: unclosed file <_io.FileIO ...>" at the
    # launcher's exit where warnings show: the store's pipes, each agent's output.
    proc = subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", "-m", "ringtrain", "run", "-np", "2",
         "--", sys.executable, "-c", f"raise SystemExit({code})"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == code, proc.stderr
    assert "ResourceWarning" not in proc.stderr, proc.stderr


def test_launcher_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from ringtrain import cli; "
        "rc = cli.main(['run', '-np', '1', '--', sys.executable, '-c', 'pass']); "
        "assert 'torch' not in sys.modules, 'launcher imported torch'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_finished_jobs_agents_exit_on_their_own_before_run_returns() -> None:
    """Once every agent reported done, the launcher closes their input and waits for them to
    exit (code 0), so nothing of the job is left on a host when ``ringtrain run`` returns;
    it kills only an agent that does not end (CI once found one still on a host)."""
    argv = ["run", "-np", "2", "--", sys.executable, "-c", "pass"]
    sup = Supervisor(
        options_from_args(cli.build_parser(argv).parse_args(argv)),
        out=io.StringIO(),
        err=io.StringIO(),
    )
    assert sup.run() == 0
    assert [lk.proc.returncode for lk in sup.links] == [0]


def test_an_agent_that_dies_is_reported_with_its_last_words() -> None:
    """The eof report quotes the agent's stderr (ssh's reason), even when stderr ends after
    stdout: here a child of the 'agent' writes its reason after the agent itself has gone."""
    script = "(exec 1>&-; sleep 0.2; echo 'ssh: connect to host ghost: Connection refused' >&2) &"
    events: queue.Queue[Any] = queue.Queue()
    link = AgentLink(0, Host("ghost", 1), ["sh", "-c", f"{script} exec 1>&-; exit 255"], events)
    _, msg = events.get(timeout=10)
    assert msg == {"t": "eof"}
    assert list(link.err_tail) == ["ssh: connect to host ghost: Connection refused"]


class _Recording:
    """An agent link that records what the launcher sends it."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, kind: str, **fields: Any) -> None:
        self.sent.append((kind, fields))


@pytest.mark.parametrize("hard", [False, True], ids=["rank failed", "launch error"])
def test_a_failure_stops_the_ranks_with_the_peers_notice_a_launch_error_without(
    hard: bool,
) -> None:
    """A rank's failure gives the other ranks PEER_NOTICE_S to say so before SIGTERM (and the
    job's deadline makes room for it); a launch error stops them at once."""
    argv = ["run", "-np", "2", "--", sys.executable, "-c", "pass"]
    sup = Supervisor(
        options_from_args(cli.build_parser(argv).parse_args(argv)),
        out=io.StringIO(),
        err=io.StringIO(),
    )
    link = _Recording()
    sup.links = [link]  # type: ignore[list-item]
    failure = Failure(rank=1, host="localhost", code=3, description="rank 1 exited", tail=[])
    before = time.monotonic()
    if hard:
        sup._apply(job_state.Failed(failure, before, 0.0, hard=True))
    else:
        sup._fail(failure)
    assert link.sent == [("stop", {"notice_s": 0.0 if hard else PEER_NOTICE_S})]
    assert isinstance(sup.state, job_state.Stopping)
    room = sup.state.deadline - before  # until the agents are killed
    if hard:
        assert room <= job_state.KILL_AFTER_S + 1.0
    else:
        assert room >= PEER_NOTICE_S + job_state.KILL_AFTER_S
