"""The per-host agent: starts this host's ranks, streams their output, reports how they exited.

One agent runs on every host of a job (a local child of the launcher, or over ssh). It talks to
the launcher through its stdin and stdout (:mod:`ringtrain.launch.protocol`). Its stdin is also
its lifeline: when it ends, because the launcher exited, was killed (even with SIGKILL) or the
ssh link broke, the agent stops every rank and their children, then exits. Ranks run in their
own sessions, so a terminal's Ctrl-C reaches the launcher only, which forwards it on purpose.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import psutil

from ringtrain import environ
from ringtrain.config import Config
from ringtrain.environ import Process, Ringtrain
from ringtrain.host import cpu_limits, network, open_files
from ringtrain.launch import exit_hints, leftovers, protocol
from ringtrain.launch.tuning import ALLOCATORS, LIB_DIRS

TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1
# A rank that beat once (ringtrain.init, runtime/heartbeat.py: every 0.5 s) and then stays
# silent SILENT_S is looked at: stopped (SIGSTOP, a debugger: its state says so) it is killed at
# once, and the launcher handles it like a dead rank. Silence alone is not enough: on a loaded
# host a running rank can miss its beats for seconds, and a main thread holding the GIL in C
# blocks them while the rank works; such a rank is killed only once it has also done no work for
# the job's frozen_after_s (Config; the start message's frozen_s: stuck in the kernel or a
# driver): its main thread used no CPU time and no other thread more than torch's idle
# background threads do (about 0.01 s a second).
SILENT_S = 4.0
# A rank that said it is failing leaves by itself: its shutdown is bounded (runtime/lifecycle:
# 3 s at most, milliseconds usually), then the interpreter's finalization, which takes seconds
# with torch on a loaded host. It gets this long past the grace period before SIGKILL, so that
# its exit code and last words are its own.
FAILING_GRACE_S = 7.0
# A launcher's stop follows a rank's failure: the peers that waited on that rank see their wait
# break at its exit and say so (PeerFailedError naming it), which under load takes a moment.
# SIGTERM before then would end them without those words; they get this long to begin to (the
# launcher's stop after a failure says so, as "notice_s").
PEER_NOTICE_S = 2.0
# A SIGTERM to the agent itself is passed on to its ranks only if the launcher does not pass its
# own on within this time: Slurm signals every process of a job, the ranks and the launcher too.
TERM_WAIT_S = 2.0
_MAIN_WORK_S, _THREAD_WORK_S = 0.05, 0.5
LOOK_S = 0.25  # how often a silent rank's state is read
# A rank's "stops on a preemption, step N of world G saved" (runtime/heartbeat.preempted_at).
_PREEMPTED_AT = re.compile(rb"S(\d+)/(\d+);")
_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def _cannot_start(program: str, e: OSError, cwd: str | None, path: str | None) -> list[str]:
    """Why a rank's command did not start, and what to do where that is plain. ``path``: the
    rank's PATH, where a command without a '/' was looked up."""
    here = os.path.join(cwd or ".", program)
    if isinstance(e, FileNotFoundError):
        found = here if "/" in program else shutil.which(program, path=path or os.defpath)
        if found and os.path.isfile(found):  # the file is there: what it asks for is not
            return _missing_interpreter(program, found)
        lines = [f"cannot start {program!r}: command not found"]
        if os.path.isfile(here):  # a bare name is looked up on PATH, never in the cwd
            lines.append(
                f"HINT: {program} is a file in the working directory, but a command without a "
                f"'/' is looked up on PATH: run python {program} (or ./{program}, an "
                "executable file with a #! line)."
            )
        return lines
    lines = [f"cannot start {program!r}: {e.strerror}"]
    if isinstance(e, PermissionError) and os.path.isfile(here):
        lines.append(
            f"HINT: {program} is not executable: chmod +x {program}, or name its interpreter "
            f"first (ringtrain run ... python {program})."
        )
    return lines


def _missing_interpreter(program: str, found: str) -> list[str]:
    """A file the kernel found but could not run: its #! line names a missing program (a
    shell says "bad interpreter"), or a binary's loader is missing."""
    try:
        with open(found, "rb") as f:
            first = f.readline(256).rstrip(b"\r\n")
    except OSError:
        first = b""
    if not first.startswith(b"#!"):
        return [
            f"cannot start {program!r}: {found} exists, but the loader or libraries it needs "
            "to run were not found.",
            f"HINT: check it with `ldd {found}` on this host.",
        ]
    interpreter = (first[2:].split() or [b""])[0].decode(errors="replace")
    return [
        f"cannot start {program!r}: bad interpreter: its #! line names {interpreter!r}, "
        "which does not exist on this host",
        "HINT: fix that line (e.g. #!/usr/bin/env python3), or name the interpreter first "
        f"(ringtrain run ... python {program}).",
    ]


def host_facts() -> dict[str, Any]:
    """What the launcher needs to know about this host to plan and tune its ranks."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    nodes = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist")):
        with contextlib.suppress(OSError), open(path) as f:
            nodes.append(cpu_limits.parse_cpulist(f.read()))
    allocators = {}
    for name, files in ALLOCATORS.items():
        for d in LIB_DIRS:
            found = next((f"{d}/{f}" for f in files if os.path.exists(f"{d}/{f}")), None)
            if found:
                allocators[name] = found
                break
    return {
        "hostname": socket.gethostname(),
        "cpus": cpus or list(range(os.cpu_count() or 1)),
        "numa_nodes": nodes,
        "allocators": allocators,
        "cpu_quota": cpu_limits.cpu_quota(),
        "python": sys.version.split()[0],
        "pid": os.getpid(),
    }


def _interfaces() -> list[dict[str, Any]]:
    try:
        return [i.to_dict() for i in network.local_interfaces()]
    except Exception:  # discovery is advisory; the launcher reports if it needs it
        return []


class Agent:
    """Runs ranks and relays what happens to them. One instance per agent process."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._write_lock = threading.Lock()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._tails: dict[int, collections.deque[str]] = {}
        # rank -> its command and PATH, for what its exit report hints (exit_hints)
        self._commands: dict[int, tuple[list[str], str | None]] = {}
        self._readers: dict[int, list[threading.Thread]] = {}
        self._grace_s = 3.0
        self._frozen_s = Config.frozen_after_s
        self._stopping = False
        self._beats: dict[int, float] = {}  # rank -> time of its last heartbeat
        self._silent: dict[int, float] = {}  # rank -> how long it was silent when killed
        # rank -> when it said it fails or leaves (runtime/heartbeat.py), on this host's clock
        self._left_at: dict[int, float] = {}
        self._failing: set[int] = set()  # ranks that said an uncaught exception ends them
        self._after_peer: set[int] = set()  # ... one that says a peer left first
        # Ranks that stop on a preemption: [step saved, world] (None: not said).
        self._preempted: dict[int, list[int] | None] = {}
        self._signalled: set[int] = set()  # ranks this agent sent a signal (stop, Ctrl-C)
        self._killed: set[int] = set()  # ... SIGKILL when a forwarded signal's grace ran out
        # silent rank -> (since when it did no work, last look, its threads' CPU seconds then)
        self._idle: dict[int, tuple[float, float, dict[tuple[int, int], float]]] = {}

    def send(self, kind: str, **fields: Any) -> None:
        # If the launcher is gone, the stdin watcher stops everything.
        with self._write_lock, contextlib.suppress(BrokenPipeError, ValueError):
            protocol.send(self._out, kind, **fields)

    # ---- starting ----------------------------------------------------------------------------

    def start(self, msg: dict[str, Any]) -> None:
        self._grace_s = float(msg.get("grace_s", 3.0))
        self._frozen_s = float(msg.get("frozen_s", Config.frozen_after_s))
        cwd = msg.get("cwd") or None
        if cwd and not os.path.isdir(cwd):
            cwd = None
        key = msg.get("key")
        self._fit_open_files(msg["ranks"])
        for r in msg["ranks"]:
            self._spawn(r, cwd, key)
        for r in self._procs:
            for fd, stream in ((1, self._procs[r].stdout), (2, self._procs[r].stderr)):
                t = threading.Thread(target=self._pump, args=(r, fd, stream), daemon=True)
                t.start()
                self._readers.setdefault(r, []).append(t)
        threading.Thread(target=self._reap, daemon=True).start()

    def _fit_open_files(
        self,
        ranks: list[dict[str, Any]],
        raise_for: Callable[[int], str | None] = open_files.raise_for,
    ) -> None:
        """Raise the open-file limit the ranks inherit to what a job of their size may need
        (:mod:`ringtrain.host.open_files`), and say so in one line the launcher prints."""
        sizes = [int(r["env"].get(Ringtrain.SIZE) or 0) for r in ranks]
        if not sizes or max(sizes) < 1:
            return  # an elastic rank learns its world later; nothing to size by
        try:
            line = raise_for(max(sizes))
        except (OSError, ValueError) as e:  # a limit this process may not change: say so
            line = f"could not raise the open-file limit (RLIMIT_NOFILE): {e}"
        if line:
            self.send("note", line=line)

    def _spawn(self, r: dict[str, Any], cwd: str | None, key: str | None) -> None:
        rank = int(r["rank"])
        env = dict(environ.current())
        env.update(r["env"])
        cpus = r.get("cpus")
        beat_r, beat_w = os.pipe()
        env[Ringtrain.HEARTBEAT_FD] = str(beat_w)
        pass_fds: tuple[int, ...] = (beat_w,)
        key_w = None
        if key:
            # The job key reaches the rank through an inherited pipe, never argv or env.
            key_r, key_w = os.pipe()
            env[Ringtrain.KEY_FD] = str(key_r)
            pass_fds = (beat_w, key_r)
        self._tails[rank] = collections.deque(maxlen=TAIL_LINES)
        self._commands[rank] = (list(r["argv"]), env.get(Process.PATH))
        try:
            proc = subprocess.Popen(
                r["argv"],
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=pass_fds,
                preexec_fn=_child_setup(cpus),
            )
        except OSError as e:
            tail = _cannot_start(r["argv"][0], e, cwd, env.get(Process.PATH))
            self._tails[rank].extend(tail)
            # A shell's codes: 127 not found, 126 found but not runnable.
            code = 127 if isinstance(e, FileNotFoundError) else 126
            self.send("exit", rank=rank, code=code, signal=None, tail=tail)
            os.close(beat_r)
            return
        finally:
            os.close(beat_w)
            if key_w is not None:
                with contextlib.suppress(OSError):
                    os.write(key_w, key.encode() + b"\n")  # type: ignore[union-attr]
                os.close(key_w)
                os.close(pass_fds[1])
        self._procs[rank] = proc
        threading.Thread(target=self._listen, args=(rank, beat_r), daemon=True).start()
        self.send("started", rank=rank, pid=proc.pid)

    def _listen(self, rank: int, fd: int) -> None:
        """Note each heartbeat of ``rank`` (none come from a rank that never calls init)."""
        try:
            while data := os.read(fd, 4096):
                if b"F" in data or b"P" in data or b"L" in data or b"S" in data:
                    self._left_at.setdefault(rank, time.time())
                    if b"F" in data or b"P" in data:
                        self._failing.add(rank)
                    if b"P" in data:
                        self._after_peer.add(rank)
                    if b"S" in data:
                        at = _PREEMPTED_AT.search(data)
                        self._preempted[rank] = [int(at[1]), int(at[2])] if at else None
                        if at:  # the launcher takes the ranks that stop together out at once
                            self.send("stopping", rank=rank, at=self._preempted[rank])
                if b"!" in data:  # goodbye: exiting; the beats stop before the process does
                    self._beats.pop(rank, None)
                    self._silent[rank] = 0.0  # never checked again
                    continue
                self._beats[rank] = time.monotonic()
        except OSError:
            pass
        finally:
            os.close(fd)

    def _check_silent(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        """Kill ``rank`` if it beat before, has been silent for :data:`SILENT_S`, and is stopped
        or has done no work for the job's ``frozen_after_s`` (the start message's frozen_s)."""
        last = self._beats.get(rank)
        if last is None or rank in self._silent or self._stopping:
            return
        now = time.monotonic()
        silent = now - last
        if silent < SILENT_S:
            self._idle.pop(rank, None)
            return
        since, looked, cpu = self._idle.get(rank, (now, 0.0, {}))
        if now - looked < LOOK_S:
            return
        tree = _process_tree(proc.pid)
        if any(_status(p) in _STOPPED for p in tree):
            why = "stopped"
        else:
            if rank not in self._idle or _worked(cpu, _thread_cpu(tree)):
                self._idle[rank] = (now, now, _thread_cpu(tree))  # working, or starved: wait
                return
            self._idle[rank] = (since, now, cpu)
            if now - since < self._frozen_s:
                return
            why = f"frozen: no work for {now - since:.0f} s"
        self._silent[rank] = silent
        line = (
            f"ringtrain: rank {rank} (pid {proc.pid}) stopped responding: no heartbeat for "
            f"{silent:.1f} s ({why}); killing it"
        )
        self._tails[rank].append(line)
        self.send("out", rank=rank, fd=2, line=line, end="\n")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def _pump(self, rank: int, fd: int, stream: IO[bytes] | None) -> None:
        """Relay output as it comes, split at newlines and at carriage returns, so progress
        bars (which redraw with ``\r``) show progress instead of arriving all at once."""
        assert stream is not None
        pending = b""
        while True:
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                break
            pending += chunk
            while True:
                cut = min(
                    (i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0), default=-1
                )
                if cut < 0:
                    break
                self._emit(rank, fd, pending[:cut], pending[cut : cut + 1].decode())
                pending = pending[cut + 1 :]
        if pending:
            self._emit(rank, fd, pending, "\n")

    def _emit(self, rank: int, fd: int, raw: bytes, end: str) -> None:
        line = raw.decode(errors="replace")
        if fd == 2 and end == "\n":
            self._tails[rank].append(line)
        self.send("out", rank=rank, fd=fd, line=line, end=end)

    def _reap(self) -> None:
        pending = dict(self._procs)
        swept = time.monotonic()
        while pending:
            if time.monotonic() - swept > 1.0:  # orphans that ended while their rank runs
                swept = time.monotonic()
                leftovers.reap_orphans(self._live_pids())
            for rank, proc in list(pending.items()):
                # Seen ended but not reaped: its pid still names its session, not a newcomer's.
                held = leftovers.has_exited(proc.pid)
                if not held and proc.poll() is None:
                    try:
                        self._check_silent(rank, proc)
                    except Exception as e:  # the check must never stop the reaping of exits
                        self._silent[rank] = 0.0  # never checked again
                        line = f"ringtrain: cannot watch rank {rank}'s heartbeat any more: {e!r}"
                        self.send("out", rank=rank, fd=2, line=line, end="\n")
                    continue
                del pending[rank]
                exited_at = time.time()  # before the pumps drain, which can take a second
                if held:  # its children end with it (and close the output pipes they share)
                    leftovers.end_session(proc.pid)
                code = proc.wait()
                # Let the output pumps drain so the exit report comes after the last lines.
                for t in self._readers.get(rank, []):
                    t.join(1.0)
                sig = signal.Signals(-code).name if code < 0 else None
                tail = list(self._tails[rank])
                self.send(
                    "exit",
                    rank=rank,
                    code=code if code >= 0 else None,
                    signal=sig,
                    tail=tail,
                    hint=exit_hints.for_exit(tail, *self._commands[rank]) if code > 0 else [],
                    silent_s=self._silent.get(rank) or None,
                    # When it failed or began to leave (else exited), on this host's clock:
                    # the launcher names the earliest as the root cause.
                    at=self._left_at.get(rank, exited_at),
                    failing=rank in self._failing,
                    after_peer=rank in self._after_peer,
                    preempted=rank in self._preempted and rank not in self._failing,
                    preempted_at=self._preempted.get(rank),
                    stopped=rank in self._signalled,  # its end was ours, not its own
                    killed=rank in self._killed,
                )
            time.sleep(0.02)
        if not self._live_pids():  # what the ranks left behind (their orphans are ours)
            leftovers.sweep(self._grace_s)
        self.send("done")

    def _live_pids(self) -> set[int]:
        return {p.pid for p in self._procs.values() if p.returncode is None}

    # ---- stopping ----------------------------------------------------------------------------

    def signal_all(
        self, sig: signal.Signals, spare: set[int] | frozenset[int] = frozenset()
    ) -> None:
        for rank, proc in self._procs.items():
            if proc.poll() is None and rank not in spare:
                self._signalled.add(rank)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)

    def stop_all(self, notice_s: float = 0.0) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after the grace period.
        A rank that said it is failing is left to end by itself (it leaves within seconds,
        runtime/lifecycle) until then, so that its exit code and last words are its own.
        ``notice_s``: how long ranks that have not said so get to say it first."""
        if self._stopping:
            return
        self._stopping = True
        tree = self._descendants()
        deadline = time.monotonic() + notice_s
        while time.monotonic() < deadline and self._unaware():
            time.sleep(0.05)
        # Ranks that said they fail or leave (shutdown began) end by themselves within
        # seconds: their exit code is their own, and may be the job's root cause.
        leaving = self._leaving()
        self.signal_all(signal.SIGTERM, spare=leaving)
        start = time.monotonic()
        deadline = start + self._grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self._procs.values()):
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL, spare=leaving)
        deadline = start + self._grace_s + FAILING_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self._procs.values()):
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        # Children that left their rank's process group are found through the process tree.
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.kill()
        leftovers.sweep(0.0, self._live_pids())  # orphans of ranks that had already exited

    def _leaving(self) -> set[int]:
        """Ranks that said they are failing or leaving (shutdown began)."""
        return self._failing | set(self._left_at.copy())

    def _unaware(self) -> list[int]:
        """Ranks still running that have not said they are failing or leaving."""
        leaving = self._leaving()
        return [r for r, p in self._procs.items() if p.poll() is None and r not in leaving]

    def kill_all(self) -> None:
        """SIGKILL every rank still running, and what it started: the grace period after a
        forwarded Ctrl-C or SIGTERM is over (no second SIGTERM: a handler would start over)."""
        self._killed |= {r for r, p in self._procs.items() if p.poll() is None}
        tree = self._descendants()
        self.signal_all(signal.SIGKILL)
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.kill()

    def _descendants(self) -> list[psutil.Process]:
        out = []
        for proc in self._procs.values():
            with contextlib.suppress(psutil.Error):
                out.extend(psutil.Process(proc.pid).children(recursive=True))
        return out

    def wait_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self._procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))


def _process_tree(pid: int) -> list[psutil.Process]:
    """The rank's process and its descendants (a wrapper script's child may be the rank)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _status(p: psutil.Process) -> str:
    try:
        return str(p.status())
    except psutil.Error:
        return ""


def _thread_cpu(tree: list[psutil.Process]) -> dict[tuple[int, int], float]:
    """CPU seconds of every thread of ``tree``, by (process, thread)."""
    cpu = {}
    for p in tree:
        with contextlib.suppress(psutil.Error):
            for t in p.threads():
                cpu[(p.pid, t.id)] = float(t.user_time + t.system_time)
    return cpu


def _worked(before: dict[tuple[int, int], float], now: dict[tuple[int, int], float]) -> bool:
    """Whether a main thread ran, or another thread did more than idle background work."""
    for (pid, tid), t in now.items():
        gained = t - before.get((pid, tid), t)
        if gained > (_MAIN_WORK_S if tid == pid else _THREAD_WORK_S):
            return True
    return False


def _child_setup(cpus: list[int] | None) -> Callable[[], None]:
    def setup() -> None:
        # Die with the agent even if it is SIGKILLed (Linux only; harmless elsewhere).
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if cpus:
            with contextlib.suppress(OSError, AttributeError):
                os.sched_setaffinity(0, cpus)

    return setup


def _ignore(_signum: int, _frame: Any) -> None:
    pass


def main() -> int:
    out = sys.stdout
    # Ranks' output must never be mistaken for protocol messages: only this object writes here.
    sys.stdout = sys.stderr
    agent = Agent(out)
    args = sys.argv[1:]
    if "--no-interfaces" in args:  # no enumeration: only the named ones, by ioctl
        names = args[args.index("--interface-names") + 1] if "--interface-names" in args else ""
        named = network.named_interfaces([n for n in names.split(",") if n])
        interfaces = [i.to_dict() for i in named]
    else:
        interfaces = _interfaces()
    agent.send(
        "hello", version=protocol.PROTOCOL_VERSION, facts=host_facts(), interfaces=interfaces
    )

    forwarded = threading.Event()  # the launcher passed a signal on, or stops the ranks

    def on_term(_signum: int, _frame: Any) -> None:
        # Where the launcher got it too (Slurm's job cancel), so did the ranks: one more each
        # would be one too many for a rank that saves in its handler (the launcher's own comes
        # anyway). Where this agent alone got it, its ranks get it from here; the launcher then
        # hears of their exits and ends or re-forms the job as for any.
        def unless_forwarded() -> None:
            if not forwarded.is_set():
                agent.signal_all(signal.SIGTERM)

        timer = threading.Timer(TERM_WAIT_S, unless_forwarded)
        timer.daemon = True  # an agent whose launcher is gone must not wait for it to exit
        timer.start()

    def on_hangup(signum: int, _frame: Any) -> None:  # the ssh session to the launcher ended
        agent.stop_all()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_hangup)
    # The launcher forwards Ctrl-C explicitly. A no-op handler, not SIG_IGN: an ignored signal
    # stays ignored across exec, so the ranks would never see the forwarded SIGINT.
    signal.signal(signal.SIGINT, _ignore)
    leftovers.become_subreaper()  # a rank's orphans become ours, not init's (leftovers.py)
    for line in sys.stdin:
        msg = protocol.parse(line)
        if msg is None:
            continue
        if msg["t"] == "start":
            agent.start(msg)
        elif msg["t"] == "signal":
            forwarded.set()
            agent.signal_all(signal.Signals[msg["sig"]])
        elif msg["t"] == "stop":
            forwarded.set()
            agent.stop_all(float(msg.get("notice_s", 0.0)))
        elif msg["t"] == "kill":
            forwarded.set()
            agent.kill_all()
    # Lifeline cut (or the launcher is finished): nothing may outlive it.
    agent.stop_all()
    agent.wait_all(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
